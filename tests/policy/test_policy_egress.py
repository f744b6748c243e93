"""The policy rates an http step by where it goes: an internal destination,
in any spelling, is denied (high when allow-listed) before anything runs.
These steps are only ever evaluated, never run; the rating itself must not
connect anywhere."""

import socket
import time

import pytest

from runs.models import Run
from runtime import egress

INTERNAL = [
    ("http://127.0.0.1/", "127.0.0.1", "loopback"),
    ("http://127.1:8000/", "127.0.0.1", "loopback"),
    ("http://2130706433/", "127.0.0.1", "loopback"),
    ("http://0x7f000001/", "127.0.0.1", "loopback"),
    ("http://0177.0.0.1/", "127.0.0.1", "loopback"),
    ("http://0.0.0.0:5432/", "0.0.0.0", "unspecified"),
    ("http://[::1]/", "::1", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "::ffff:7f00:1", "IPv4-mapped (embeds 127.0.0.1, loopback)"),
    ("http://localhost:6379/", "127.0.0.1", "loopback"),
    ("http://LOCALHOST./", "127.0.0.1", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254",
     "cloud metadata (AWS, GCP, Azure, OpenStack, Oracle)"),
    ("http://[fd00:ec2::254]/latest/", "fd00:ec2::254", "cloud metadata (AWS IMDS over IPv6)"),
    ("http://100.100.100.200/", "100.100.100.200", "cloud metadata (Alibaba Cloud)"),
    ("https://10.0.0.1/", "10.0.0.1", "private (RFC 1918)"),
    ("http://192.168.0.1/", "192.168.0.1", "private (RFC 1918)"),
    ("http://100.64.0.1/", "100.64.0.1", "shared CGNAT (RFC 6598)"),
    ("http://[fe80::1]/", "fe80::1", "link-local"),
]


def plan(url, method="GET"):
    return {"steps": [{"id": "s1", "tool": "http", "params": {"method": method, "url": url}}]}


@pytest.fixture(autouse=True)
def no_connect(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the rating connected somewhere")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.django_db
@pytest.mark.parametrize("url,address,kind", INTERNAL)
def test_an_internal_destination_is_denied_by_evaluate(api, url, address, kind):
    response = api.post("/api/v1/policy/evaluate", {"plan": plan(url)}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["risk"], body["rejected"]) == ("deny", True)
    [step] = body["steps"]
    article = "an" if kind.startswith(("IPv4", "u")) else "a"
    assert f"egress: destination {address} is {article} {kind} address" in step["reasons"]
    assert step["risk"] == "deny"
    assert Run.objects.count() == 0


@pytest.mark.django_db
def test_the_denial_names_the_address_and_class(tenant):
    from policy.interface import policy_dry_run

    decision = policy_dry_run(plan=plan("http://2130706433/"), tenant=tenant)
    assert decision.data["rejected_by"] == "egress"
    assert decision.error["code"] == "denied"
    assert decision.error["message"] == "step s1: destination 127.0.0.1 is a loopback address"
    assert decision.error["details"]["egress"] == [{"step": "s1", "address": "127.0.0.1", "class": "loopback"}]


@pytest.mark.django_db
def test_an_allow_listed_internal_destination_is_high(api, settings):
    settings.EXECGO_HTTP_ALLOWED_NETWORKS = ["10.0.0.0/8"]
    body = api.post("/api/v1/policy/evaluate", {"plan": plan("http://10.1.2.3/")}, format="json").json()
    assert (body["risk"], body["rejected"], body["needs_human"]) == ("high", False, True)
    assert "egress: destination 10.1.2.3 is a private (RFC 1918) address, in EXECGO_HTTP_ALLOWED_NETWORKS" in \
        body["steps"][0]["reasons"]


@pytest.mark.django_db
def test_a_name_that_resolves_internal_is_denied(api, monkeypatch):
    monkeypatch.setattr(egress, "resolve_name", lambda host, port: ["169.254.169.254"])
    body = api.post("/api/v1/policy/evaluate", {"plan": plan("http://metadata.test/")}, format="json").json()
    assert body["risk"] == "deny"


@pytest.mark.django_db
def test_a_lookup_that_hangs_or_fails_is_quick_and_lowers_nothing(api, monkeypatch, seeded_policy):
    def hang(host, port):
        time.sleep(5)
        return ["127.0.0.1"]

    monkeypatch.setattr(egress, "resolve_name", hang)
    started = time.monotonic()
    slow = api.post("/api/v1/policy/evaluate", {"plan": plan("https://slow.test/", method="DELETE")},
                    format="json").json()
    assert time.monotonic() - started < 4
    # The seeded rules still rate it (a DELETE is high): an unknown destination lowers nothing.
    assert slow["risk"] == "high" and slow["rejected"] is False
    failing = api.post("/api/v1/policy/evaluate", {"plan": plan("https://nowhere.test/")}, format="json").json()
    assert failing["risk"] == "low"


@pytest.mark.django_db
def test_public_destinations_and_allowed_hosts_keep_their_rating(api, settings, seeded_policy):
    settings.EXECGO_HTTP_ALLOWED_HOSTS = ["api.example.com"]
    body = api.post("/api/v1/policy/evaluate", {"plan": plan("https://api.example.com/x", method="POST")},
                    format="json").json()
    assert body["risk"] == "low"
    assert any("waived" in reason for reason in body["steps"][0]["reasons"])
    public = api.post("/api/v1/policy/evaluate", {"plan": plan("https://8.8.8.8/")}, format="json").json()
    assert public["risk"] == "low" and "egress" not in public["steps"][0]
