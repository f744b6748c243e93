"""The signature of outgoing webhooks (runs/webhooks.py, sign and verify):
the HMAC of timestamp, URL and body; a tampered body, a wrong or empty
secret, another URL, a timestamp outside the window, a replayed timestamp
and malformed headers are refused; and the README's snippet agrees with
verify."""

import re
import time
from pathlib import Path

import pytest

from runs.webhooks import sign, verify

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-for-tests"  # of the sign/verify tests; a delivery is signed with its tenant's own


URL = "https://hooks.example/execgo"


def signed_headers(body: bytes, *, secret: str = SECRET, timestamp: int | None = None, url: str = URL) -> dict:
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {"X-ExecGo-Timestamp": str(timestamp),
            "X-ExecGo-Signature": f"sha256={sign(secret, timestamp, url, body)}"}


# --- sign and verify -----------------------------------------------------------

BODY = b'{"id":1,"event":"approval.requested","data":{"request":7}}'


def test_a_signed_body_verifies():
    assert verify(SECRET, signed_headers(BODY), BODY, url=URL)
    # Header names are matched without regard to case.
    assert verify(SECRET, {name.lower(): value for name, value in signed_headers(BODY).items()}, BODY, url=URL)


def test_the_signature_is_the_hmac_of_timestamp_dot_url_dot_body():
    import hashlib
    import hmac

    assert sign("k", 1700000000, "https://h.example/x", b"{}") == hmac.new(
        b"k", b"1700000000.https://h.example/x.{}", hashlib.sha256).hexdigest()


def test_a_tampered_body_is_refused():
    assert not verify(SECRET, signed_headers(BODY), BODY.replace(b"7", b"8"), url=URL)


def test_a_wrong_secret_is_refused():
    assert not verify(SECRET, signed_headers(BODY, secret="another secret"), BODY, url=URL)
    assert not verify("another secret", signed_headers(BODY), BODY, url=URL)
    assert not verify("", signed_headers(BODY, secret=""), BODY, url=URL)  # no secret never verifies


@pytest.mark.parametrize("other_url", [URL + "2", URL.replace("https", "http"), "https://evil.example/execgo",
                                       URL + "?x=1", ""])
def test_a_signature_for_one_url_is_refused_at_another(other_url):
    assert not verify(SECRET, signed_headers(BODY), BODY, url=other_url)
    assert verify(SECRET, signed_headers(BODY, url=other_url), BODY, url=other_url)


@pytest.mark.parametrize("skew", [-301, 301, -3600])
def test_a_timestamp_outside_the_window_is_refused(skew):
    now = time.time()
    stale = signed_headers(BODY, timestamp=int(now) + skew)  # correctly signed, but outside the window
    assert not verify(SECRET, stale, BODY, url=URL, now=now)
    assert verify(SECRET, stale, BODY, url=URL, now=now, tolerance_s=abs(skew) + 1)


def test_a_replayed_timestamp_does_not_pass_with_another_timestamp():
    headers = signed_headers(BODY)
    headers["X-ExecGo-Timestamp"] = str(int(headers["X-ExecGo-Timestamp"]) + 1)  # "refresh" a captured request
    assert not verify(SECRET, headers, BODY, url=URL)


@pytest.mark.parametrize("headers", [
    {},
    {"X-ExecGo-Timestamp": "soon", "X-ExecGo-Signature": "sha256=00"},
    {"X-ExecGo-Timestamp": str(int(time.time()))},
    {"X-ExecGo-Timestamp": str(int(time.time())), "X-ExecGo-Signature": "sha256=é"},
])
def test_malformed_headers_are_refused(headers):
    assert not verify(SECRET, headers, BODY, url=URL)


def test_the_readme_snippet_agrees_with_verify():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### Webhooks\n", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(snippet.strip().splitlines()) <= 12
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102 (our own README)
    valid = namespace["valid"]
    now = int(time.time())
    cases = [
        (signed_headers(BODY), BODY),
        (signed_headers(BODY), BODY + b" "),
        (signed_headers(BODY, secret="nope"), BODY),
        (signed_headers(BODY, timestamp=now - 301), BODY),
        ({}, BODY),
        (signed_headers(BODY, url=URL + "/other"), BODY),
    ]
    expected = [True, False, False, False, False, False]
    assert [valid(SECRET, URL, headers, body) for headers, body in cases] == expected
    assert [verify(SECRET, headers, body, url=URL) for headers, body in cases] == expected
