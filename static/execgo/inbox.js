// The approvals inbox: selecting requests for a bulk decision.
(function () {
  "use strict";
  var form = document.getElementById("bulk-form");
  if (!form) return;
  var count = document.getElementById("bulk-count");

  function picks() {
    return Array.prototype.slice.call(document.querySelectorAll("#approval-requests input[name=pick]"));
  }

  function update() {
    var chosen = picks().filter(function (box) { return box.checked; }).length;
    count.textContent = chosen + " selected";
    var all = document.getElementById("bulk-all");
    if (all) all.checked = chosen > 0 && chosen === picks().length;
    if (window.execgoLive && window.execgoLive.releaseRefresh) window.execgoLive.releaseRefresh();
  }

  document.addEventListener("change", function (event) {
    if (event.target.id === "bulk-all") {
      picks().forEach(function (box) { box.checked = event.target.checked; });
    }
    if (event.target.id === "bulk-all" || event.target.name === "pick") update();
  });
  document.addEventListener("htmx:afterSwap", update);
  form.addEventListener("submit", function (event) {
    if (!picks().some(function (box) { return box.checked; })) {
      event.preventDefault();
      count.textContent = "Select at least one request first.";
    }
  });
})();
