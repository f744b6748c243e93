"""The approvers' pages: the inbox and one request. Reads are scoped to the
approver's tenant (another tenant's request is a 404); decisions are POSTs
with a CSRF token that call ``approvals.services.approval_decide``, one
request at a time or several from the inbox (``approvals.bulk``)."""

from urllib.parse import urlsplit

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login as auth_login
from django.contrib.auth import logout as auth_logout
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from approvals.bulk import approval_decide_many
from approvals.grants import grant_revoke, grants_for_user
from approvals.links import SOMEONE_ELSES, audit_refused, link_decide, link_refusal
from approvals.models import APPROVERS_GROUP, ApprovalStatus, Notification, NotificationSettings
from approvals.notify import chat_host_allowed, link_of
from approvals.selectors import request_for_user, requests_for_user
from approvals.services import approval_decide
from execgo.middleware import LINK_ONLY_SESSION_KEY
from runs.audit import audit
from runs.errors import ExecGoError
from runs.models import AuditEvent
from runs.selectors import latest_event_id, tenant_of


def _approver(request) -> None:
    if not request.user.groups.filter(name=APPROVERS_GROUP).exists():
        raise PermissionDenied("only approvers see the approvals inbox")


@login_required
@require_GET
def inbox(request):
    _approver(request)
    status = request.GET.get("status", ApprovalStatus.PENDING)
    if status not in ApprovalStatus.values and status != "decided":
        status = ApprovalStatus.PENDING
    cursor = latest_event_id()
    template = "approvals/inbox.html#requests" if request.GET.get("fragment") == "requests" else "approvals/inbox.html"
    return render(request, template, {"requests": requests_for_user(request.user, status=status)[:200],
                                      "status": status, "statuses": ApprovalStatus.values, "live_after": cursor,
                                      "nav": "approvals"})


@login_required
@require_GET
def detail(request, request_id: int):
    _approver(request)
    approval = request_for_user(request.user, request_id)
    if approval is None:
        raise Http404("no such approval request")
    editable = any("argv" in step["action"] or "script" in step["action"] or step["action"].get("tool") == "http"
                   for step in approval.steps)
    cap = approval.tenant.standing_grant_max_hours if approval.approvals_required == 1 else 0
    grant_choices = sorted({hours for hours in (1, 2, 4, 8, 24) if hours <= cap} | ({cap} if cap else set()))
    return render(request, "approvals/detail.html", {"approval": approval, "run": approval.run, "editable": editable,
                                                     "grant_choices": grant_choices,
                                                     "decisions": list(approval.decisions.select_related("decider")),
                                                     "live_after": latest_event_id(), "nav": "approvals"})


def _edits_from(form, approval) -> dict[str, dict]:
    """The approver's edits from the "approve with edits" form: one field per
    editable step (argv one argument a line, a script, or a URL); unchanged
    fields are no edit."""
    edits: dict[str, dict] = {}
    for index, step in enumerate(approval.steps):
        action = step["action"]
        if f"edit-{index}-argv" in form and "argv" in action:
            # Compared as the text the form showed: an untouched field is no edit, whatever its arguments hold.
            text = form[f"edit-{index}-argv"].replace("\r\n", "\n")
            if text.rstrip("\n") != "\n".join(action["argv"]).rstrip("\n"):
                edits[action["id"]] = {"argv": [line for line in text.split("\n") if line != ""]}
        elif f"edit-{index}-script" in form and "script" in action:
            script = form[f"edit-{index}-script"].replace("\r\n", "\n")
            if script != action["script"]:
                edits[action["id"]] = {"script": script}
        elif f"edit-{index}-url" in form and action.get("tool") == "http":
            url = form[f"edit-{index}-url"].strip()
            if url != action.get("url"):
                edits[action["id"]] = {"url": url}
    return edits


@login_required
@require_POST
def decide(request, request_id: int, verdict: str):
    approval = request_for_user(request.user, request_id)
    if approval is None:
        raise Http404("no such approval request")
    comment = request.POST.get("comment", "").strip()[:2000]
    edits = _edits_from(request.POST, approval) if verdict == "approve-edited" else None
    hours = request.POST.get("grant_hours", "")
    grant_hours = int(hours) if verdict == "approve" and hours.isdecimal() and len(hours) < 6 else None
    if verdict == "approve-edited" and not edits:
        messages.error(request, "Nothing was edited: use Approve.")
        return redirect("approvals:detail", request_id=approval.pk)
    try:
        # The digest of the page the approver decided on (its hidden field).
        outcome = approval_decide(request=approval, actor=request.user, approve=verdict != "reject",
                                  digest=request.POST.get("digest", ""), comment=comment, edits=edits,
                                  grant_hours=grant_hours)
    except ExecGoError as exc:
        messages.error(request, exc.envelope["message"])
        return redirect("approvals:detail", request_id=approval.pk)
    if outcome.request.status == ApprovalStatus.PENDING:
        messages.success(request, f"Approved: {outcome.approvals} of {outcome.request.approvals_required} "
                                  "approvals so far.")
    else:
        messages.success(request, f"Request {outcome.request.status}." + (
            f" The same action{'s' if len(approval.high_risk_steps) > 1 else ''} of this agent will not wait for "
            f"a person for {grant_hours} hour{'s' if grant_hours > 1 else ''}." if grant_hours else ""))
    return redirect("approvals:detail", request_id=approval.pk)


@login_required
@require_POST
def bulk_decide(request):
    """The inbox's "Approve selected" / "Reject selected": each ``pick`` is
    ``<request id>:<digest of its row>``. What was decided and each request
    refused (with its reason) are reported on the inbox."""
    _approver(request)
    inbox_url = f"{reverse('approvals:inbox')}?status=pending"
    verdict = request.POST.get("verdict")
    if verdict not in ("approve", "reject"):
        messages.error(request, "Choose Approve selected or Reject selected.")
        return redirect(inbox_url)
    picks = []
    for value in request.POST.getlist("pick"):
        request_id, _, digest = value.partition(":")
        if request_id.isdecimal() and len(request_id) < 12:
            picks.append((int(request_id), digest[:64]))
    try:
        outcomes = approval_decide_many(actor=request.user, approve=verdict == "approve",
                                        comment=request.POST.get("comment", "")[:2000], picks=picks)
    except ExecGoError as exc:
        messages.error(request, exc.envelope["message"])
        return redirect(inbox_url)
    decided = [outcome for outcome in outcomes if outcome.decided]
    if decided:
        done = "Approved" if verdict == "approve" else "Rejected"
        messages.success(request, f"{done} {len(decided)} request{'s' if len(decided) != 1 else ''}: " + ", ".join(
            f"#{outcome.request_id}" + (f" ({outcome.approvals} of {outcome.approvals_required} approvals so far)"
                                        if outcome.status == ApprovalStatus.PENDING else "")
            for outcome in decided) + ".")
    for outcome in outcomes:
        if not outcome.decided:
            messages.error(request, f"#{outcome.request_id} was not decided: {outcome.error['message']}.")
    return redirect(inbox_url)


@login_required
@require_GET
def grants(request):
    """The tenant's standing grants: the live ones first, then those ended."""
    _approver(request)
    rows = list(grants_for_user(request.user)[:200])
    now = timezone.now()
    return render(request, "approvals/grants.html", {
        "live": [grant for grant in rows if grant.live_at(now)],
        "ended": [grant for grant in rows if not grant.live_at(now)], "nav": "approvals"})


@login_required
@require_POST
def revoke_grant(request, grant_id: int):
    _approver(request)
    grant = grants_for_user(request.user).filter(pk=grant_id).first()
    if grant is None:
        raise Http404("no such standing grant")
    try:
        grant_revoke(grant, request.user)
    except ExecGoError as exc:
        messages.error(request, exc.envelope["message"])
    else:
        messages.success(request, f"Grant #{grant.pk} revoked: runs rated from now on wait for a person again.")
    return redirect("approvals:grants")


@require_http_methods(["GET", "POST"])
def decision_link(request, token: str):
    """A one-time decision link (``approvals.links``). Opening it decides
    nothing; not signed in, it asks to sign in first (mail scanners and
    chat unfurlers fetch links: they see a login page)."""
    link = link_of(token)
    if link is None:
        return render(request, "approvals/link.html", {"refused": "This link is not valid."}, status=404)
    if not request.user.is_authenticated:
        if not settings.EXECGO_DECISION_LINK_SIGN_IN:
            return redirect_to_login(request.get_full_path())
        return _link_sign_in(request, link)
    if request.method == "GET":
        refused = link_refusal(link, request.user)
        if refused is not None:
            audit_refused(link, request.user, refused, method="GET")
            return render(request, "approvals/link.html", {"refused": refused[0].upper() + refused[1:] + "."},
                          status=403 if refused == SOMEONE_ELSES else 410)
        return render(request, "approvals/link.html", {"link": link, "approval": link.request,
                                                       "run": link.request.run, "nav": "approvals"})
    verdict = request.POST.get("verdict")
    if verdict not in ("approve", "reject"):
        messages.error(request, "Choose Approve or Reject.")
        return redirect(request.path)
    try:
        outcome = link_decide(link, request.user, approve=verdict == "approve",
                              comment=request.POST.get("comment", "")[:2000])
    except ExecGoError as exc:
        if (exc.envelope.get("details") or {}).get("fields"):  # a reject without a reason: the link is still good
            messages.error(request, exc.envelope["message"])
            return redirect(request.path)
        return render(request, "approvals/link.html", {"refused": exc.envelope["message"][0].upper()
                                                       + exc.envelope["message"][1:] + "."},
                      status=exc.http_status)
    if request.session.get(LINK_ONLY_SESSION_KEY):  # a session the link opened: its work is done
        auth_logout(request)
        return render(request, "approvals/link.html", {"done": f"Request {outcome.request.status}. You are "
                                                               "signed out."})
    messages.success(request, f"Request {outcome.request.status}.")
    return redirect("approvals:detail", request_id=outcome.request.pk)


def _link_sign_in(request, link):
    """``EXECGO_DECISION_LINK_SIGN_IN``: the page names the link's approver
    and shows nothing of the request; its POST (which scanners do not send)
    signs them in, in a session good for this link's page only."""
    refused = link_refusal(link, link.recipient) or (None if link.recipient.is_active else "this account is disabled")
    if refused is not None:
        return render(request, "approvals/link.html", {"refused": refused[0].upper() + refused[1:] + "."},
                      status=410)
    if request.method == "GET" or request.POST.get("sign_in") != "1":
        return render(request, "approvals/link.html", {"sign_in_as": link.recipient.get_username()})
    auth_login(request, link.recipient, backend="django.contrib.auth.backends.ModelBackend")
    request.session[LINK_ONLY_SESSION_KEY] = request.path
    audit(AuditEvent.DECISION_LINK_SIGN_IN, run_id=link.request.run_id, tenant_id=link.tenant_id,
          actor=link.recipient, caller="approvals", data={"link": link.pk, "request": link.request_id})
    return redirect(request.path)


class NotificationSettingsForm(forms.ModelForm):
    chat_url = forms.URLField(required=False, max_length=500, assume_scheme="https",
                              label="Chat incoming-webhook URL")
    away_until = forms.DateTimeField(required=False, label="Away until (UTC)",
                                     widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
                                     input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S"])

    class Meta:
        model = NotificationSettings
        fields = ("email", "chat_url", "chat_format", "away_until", "delegate")
        labels = {"email": "E-mail me", "chat_format": "Chat format", "delegate": "Delegate while away"}

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user
        self.fields["delegate"].queryset = delegates_for(user)
        self.fields["delegate"].label_from_instance = lambda person: person.get_username()

    def clean_chat_url(self) -> str:
        url = self.cleaned_data["chat_url"].strip()
        if url and not chat_host_allowed((urlsplit(url).hostname or "").lower()):
            raise forms.ValidationError("This host is not one of the chat webhook hosts the operator allows "
                                        "(EXECGO_CHAT_WEBHOOK_HOSTS).")
        return url

    def clean(self):
        cleaned = super().clean()
        if cleaned.get("away_until") and not cleaned.get("delegate"):
            self.add_error("delegate", "Name who decides in your place while you are away.")
        return cleaned


def delegates_for(user):
    """Whom ``user`` may name: the other approvers of their tenant (never an agent identity)."""
    from django.contrib.auth import get_user_model

    tenant = tenant_of(user)
    if tenant is None:
        return get_user_model().objects.none()
    return (get_user_model().objects.filter(is_active=True, membership__tenant=tenant, groups__name=APPROVERS_GROUP)
            .exclude(groups__name="agents").exclude(pk=user.pk).distinct().order_by("username"))


@login_required
@require_http_methods(["GET", "POST"])
def notification_settings(request):
    """Each approver chooses their channels; the messages they were sent are listed."""
    _approver(request)
    prefs = NotificationSettings.objects.filter(user=request.user).first() or NotificationSettings(user=request.user)
    before = (prefs.away_until, prefs.delegate_id)
    form = NotificationSettingsForm(request.POST or None, instance=prefs, user=request.user)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            saved = form.save()
            if (saved.away_until, saved.delegate_id) != before:
                audit(AuditEvent.DELEGATION_SET, run_id=None, tenant_id=tenant_of(request.user).pk,
                      actor=request.user, caller="approvals", data={
                          "away_until": saved.away_until.isoformat() if saved.away_until else None,
                          "delegate": saved.delegate.get_username() if saved.delegate else None})
        messages.success(request, "Notification settings saved.")
        return redirect("approvals:settings")
    sent = Notification.objects.filter(recipient=request.user).select_related("request")[:50]
    return render(request, "approvals/settings.html", {"form": form, "sent": sent, "nav": "approvals",
                                                       "has_email": bool(request.user.email)})
