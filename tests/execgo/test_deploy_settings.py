"""Production settings fail closed, and ``check --deploy`` is clean on the
production environment the README documents."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# Variables of the caller's environment that would leak into the production one.
OWN = ("DJANGO_", "EXECGO_HTTPS", "EXECGO_SSL_REDIRECT", "EXECGO_HSTS_", "EXECGO_PROXY_SSL_HEADER")


def documented_production_env() -> dict[str, str]:
    """The ``KEY=value`` lines of the README's production environment block."""
    block = README.split("<!-- production-environment -->", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    pairs = dict(re.findall(r"^export ([A-Z_]+)=(\S+)", block, re.M))
    assert {"DJANGO_SECRET_KEY", "DJANGO_ALLOWED_HOSTS", "EXECGO_HTTPS"} <= set(pairs)
    return pairs


def manage(args: list[str], extra: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith(OWN)}
    env.update({"DJANGO_SETTINGS_MODULE": "execgo.settings", "EXECGO_DATA_DIR": str(tmp_path / "var"), **extra})
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def production(**overrides: str) -> dict[str, str]:
    env = documented_production_env()
    # The README shows how to make a key; the check wants a real one.
    env["DJANGO_SECRET_KEY"] = "Kq3v9Zp0-Lr7Tw2Yx8Ub5Nc1Md4Fe6Gh0Jk3Lm9Np2Qr5St8Vw1Xy4Za7Bc0De3Fg6"
    env.update(overrides)
    return {key: value for key, value in env.items() if value != "<unset>"}


def test_the_documented_production_environment_passes_check_deploy(tmp_path):
    result = manage(["check", "--deploy", "--fail-level", "WARNING"], production(), tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "System check identified no issues (0 silenced)."


def test_without_preload_the_one_remaining_warning_is_the_documented_one(tmp_path):
    result = manage(["check", "--deploy"], production(EXECGO_HSTS_PRELOAD="false"), tmp_path)

    assert re.findall(r"\((security\.W\d+)\)", result.stdout + result.stderr) == ["security.W021"]
    assert "security.W021" in README


def test_plain_http_settings_give_the_warnings_of_the_issue(tmp_path):
    """Without EXECGO_HTTPS the warnings about HTTPS are back: the settings drive them."""
    result = manage(["check", "--deploy"], production(EXECGO_HTTPS="false", EXECGO_HSTS_PRELOAD="<unset>"), tmp_path)

    found = set(re.findall(r"\((security\.W\d+)\)", result.stdout + result.stderr))
    assert found == {"security.W004", "security.W008", "security.W012", "security.W016"}


@pytest.mark.parametrize("missing, message", [
    ("DJANGO_SECRET_KEY", "Set DJANGO_SECRET_KEY to a long random string (or DJANGO_DEBUG=true for development)."),
    ("DJANGO_ALLOWED_HOSTS", "Set DJANGO_ALLOWED_HOSTS to the host names the site answers to "
                             "(or DJANGO_DEBUG=true for development)."),
])
@pytest.mark.parametrize("debug", ["<unset>", "0", "false"])
def test_debug_off_without_a_key_or_hosts_refuses_to_start(tmp_path, missing, message, debug):
    result = manage(["check"], production(**{missing: "<unset>", "DJANGO_DEBUG": debug}), tmp_path)

    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"django.core.exceptions.ImproperlyConfigured: {message}"
    assert not (tmp_path / "var" / "execgo.sqlite3").exists()


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_key_is_a_missing_key(tmp_path, value):
    result = manage(["check"], production(DJANGO_SECRET_KEY=value), tmp_path)

    assert result.returncode != 0
    assert "Set DJANGO_SECRET_KEY" in result.stderr


def test_debug_mode_starts_on_the_development_defaults(tmp_path):
    result = manage(["shell", "-v", "0", "-c", "from django.conf import settings; print(settings.ALLOWED_HOSTS, settings.DEBUG)"],
                    {"DJANGO_DEBUG": "true"}, tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['localhost', '127.0.0.1', '[::1]', 'testserver'] True"


def test_behind_a_tls_proxy_the_forwarded_proto_header_makes_a_request_secure(tmp_path):
    code = ("from django.test import Client; c = Client();"
            "print(c.get('/accounts/login/', HTTP_HOST='execgo.example.com').status_code,"
            " c.get('/accounts/login/', HTTP_HOST='execgo.example.com', HTTP_X_FORWARDED_PROTO='https').status_code,"
            " c.get('/healthz', HTTP_HOST='execgo.example.com').status_code)")
    result = manage(["shell", "-v", "0", "-c", code], production(), tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["301", "200", "200"]
