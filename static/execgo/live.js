// The pages' one websocket: resumes from the last event id it has, and
// re-renders the page's own partials when an event concerns them.
(function () {
  "use strict";
  var body = document.body;
  var scope = body.dataset.liveScope;
  var live = { events: [], lastId: Number(body.dataset.liveAfter || 0), state: "off", connects: 0 };
  window.execgoLive = live;
  var statusEl = document.getElementById("live-status");
  if (!scope) { if (statusEl) statusEl.hidden = true; return; }  // a page with nothing live on it

  var backoff = 500, socket = null;

  function setState(state, text) {
    live.state = state;
    if (statusEl) { statusEl.dataset.state = state; statusEl.textContent = text; }
  }

  function url() {
    var proto = location.protocol === "https:" ? "wss://" : "ws://";
    var params = new URLSearchParams({ scope: scope, after: String(live.lastId) });
    if (body.dataset.liveRun) params.set("run", body.dataset.liveRun);
    return proto + location.host + "/ws/live/?" + params.toString();
  }

  // The session ended (4401) or lost this page's access (4403): no
  // reconnect. The login page sends a still valid session straight back
  // here (a fresh page, a fresh socket) and asks anyone else to sign in.
  function end(code) {
    live.ended = code;
    setState("ended", code === 4401 ? "signed out" : "access ended");
    location.assign("/accounts/login/?next=" + encodeURIComponent(location.pathname + location.search));
  }

  // A refused handshake has no close code a script can read: whether the
  // session still holds is asked of this page itself. A redirect (to the
  // login) or a 401 is an ended session, a 403 a lost access; no answer is
  // a server away, tried again.
  function sessionEnd() {
    return fetch(location.pathname + location.search,
                 { method: "HEAD", credentials: "same-origin", cache: "no-store", redirect: "manual" })
      .then(function (response) {
        if (response.type === "opaqueredirect" || response.status === 401) return 4401;
        return response.status === 403 ? 4403 : null;
      })
      .catch(function () { return null; });
  }

  function connect() {
    setState("connecting", "connecting…");
    var opened = false;
    socket = new WebSocket(url());
    live.socket = socket;
    socket.onopen = function () { opened = true; live.connects += 1; backoff = 500; setState("live", "live"); };
    socket.onmessage = function (message) {
      var data = JSON.parse(message.data);
      if (data.type === "resync") { location.reload(); return; }
      if (data.type !== "event" || data.event.id <= live.lastId) return;
      live.lastId = data.event.id;
      live.events.push(data.event);
      handle(data.event);
    };
    socket.onclose = function (event) {
      if (event.code === 4401 || event.code === 4403) { end(event.code); return; }
      setState("reconnecting", "reconnecting…");
      var again = function () {
        setTimeout(connect, backoff);
        backoff = Math.min(backoff * 2, 5000);
      };
      if (opened) { again(); return; }
      sessionEnd().then(function (code) {
        if (code === null) { again(); } else { end(code); }
      });
    };
  }
  // For tests and for a page that wants to drop its connection on purpose.
  live.drop = function () { if (socket) socket.close(); };

  function debounce(fn, ms) {
    var timer = null;
    return function () { clearTimeout(timer); timer = setTimeout(fn, ms); };
  }

  // --- the runs list: rows change badge, new runs appear -------------------
  // Events of one run come in bursts, and the answers to their row requests
  // may come back in any order: an answer older than one already applied is
  // dropped, and the row is looked up when an answer is applied, so that two
  // answers for a run not yet listed insert it once.
  var rowRequested = {}, rowApplied = {};
  function refreshRow(runId) {
    var query = body.dataset.liveQuery || "";
    var request = rowRequested[runId] = (rowRequested[runId] || 0) + 1;
    return fetch("/runs/" + runId + "/row/?" + query, { credentials: "same-origin" }).then(function (response) {
      return (response.status === 204 ? Promise.resolve(null) : response.text()).then(function (html) {
        if (request <= (rowApplied[runId] || 0)) return;
        rowApplied[runId] = request;
        var row = document.getElementById("run-" + runId);
        if (html === null) { if (row) row.remove(); return; }  // no longer matches this page's filters
        var template = document.createElement("template");
        template.innerHTML = html.trim();
        var fresh = template.content.firstElementChild;
        if (!fresh) return;
        fresh.classList.add("changed");
        if (row) { row.replaceWith(fresh); return; }
        if (!body.dataset.liveFirstPage) return;  // a new run belongs on page 1 only
        var empty = document.getElementById("runs-empty");
        if (empty) empty.remove();
        var tbody = document.getElementById("runs-body");
        var later = Array.prototype.find.call(tbody.rows, function (r) { return Number(r.dataset.run) < runId; });
        tbody.insertBefore(fresh, later || null);
      });
    });
  }
  live.refreshRow = refreshRow;  // for tests: what an event of the run does (a promise of its end)

  // --- the run page: the live partial, and log tails while steps run ------
  var refreshRun = debounce(function () {
    htmx.ajax("GET", location.pathname + "?fragment=live", { target: "#run-live", swap: "outerHTML" });
  }, 120);

  function pollLog(pre) {
    if (pre.dataset.polling) return;
    pre.dataset.polling = "1";
    var offset = 0, first = true;
    function next() {
      fetch(pre.dataset.logUrl + "&offset=" + offset, { credentials: "same-origin", cache: "no-store" })
        .then(function (response) {
          offset = Number(response.headers.get("X-Log-Offset") || offset);
          var running = response.headers.get("X-Step-Running") === "1";
          return response.text().then(function (text) {
            if (first) { pre.textContent = text; first = false; } else if (text) { pre.textContent += text; }
            pre.scrollTop = pre.scrollHeight;
            if (running) { setTimeout(next, 300); } else { delete pre.dataset.polling; pre.dataset.running = ""; }
          });
        })
        .catch(function () { setTimeout(next, 1000); });
    }
    next();
  }

  function startLogs(stepId) {
    document.querySelectorAll("[data-log-step] pre.log").forEach(function (pre) {
      if (stepId === undefined ? pre.dataset.running === "1" : pre.closest("[data-log-step]").dataset.logStep === stepId) {
        pollLog(pre);
      }
    });
  }

  // A page that names a partial to refresh on any of its events (the approvals inbox).
  // While rows of it are selected for a bulk decision it is not refreshed: each
  // selected row must keep the view (and the digest) its approver chose it on.
  function heldBySelection() {
    return document.querySelector(body.dataset.liveRefresh + " input[name=pick]:checked") !== null;
  }

  function noteHeld(held) {
    var note = document.getElementById("inbox-changed");
    if (note) note.hidden = !held;
  }

  var refreshTarget = debounce(function () {
    if (heldBySelection()) { live.refreshHeld = true; noteHeld(true); return; }
    htmx.ajax("GET", body.dataset.liveRefreshUrl, { target: body.dataset.liveRefresh, swap: "outerHTML" });
  }, 150);

  // Called by the inbox when its selection changes: a refresh held back happens once nothing is selected.
  live.releaseRefresh = function () {
    if (live.refreshHeld && !heldBySelection()) { live.refreshHeld = false; noteHeld(false); refreshTarget(); }
  };

  var reloadOverview = debounce(function () {
    fetch(location.href, { credentials: "same-origin" }).then(function (r) { return r.text(); }).then(function (html) {
      var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("content");
      if (fresh) document.getElementById("content").innerHTML = fresh.innerHTML;
    });
  }, 1000);

  // --- an approval request's page: told at once when the plan it shows is edited ---
  function noteApprovalChange(event) {
    var seen = body.dataset.approvalDigest, banner = document.getElementById("approval-stale");
    if (!seen || !banner || !event.data || !event.data.digest || event.data.digest === seen) return;
    var why = document.getElementById("approval-stale-why");
    if (why && event.data.edited_by) why.textContent = "edited by " + event.data.edited_by;
    banner.hidden = false;
  }

  function handle(event) {
    document.dispatchEvent(new CustomEvent("execgo:event", { detail: event }));
    if (event.type === "approval_changed") noteApprovalChange(event);
    if (scope === "run" && document.getElementById("run-live")) {
      refreshRun();
      if (event.type === "task_started") startLogs(event.task_id);
    } else if (body.dataset.liveRefresh) {
      refreshTarget();
    } else if (body.dataset.liveReload === "overview") {
      reloadOverview();
    } else if (scope === "runs" && event.type === "run_state_changed") {
      refreshRow(event.run_id);
    }
  }

  if (scope === "run") startLogs();
  connect();
})();
