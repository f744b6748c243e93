"""The client is a distribution of its own: importing it loads nothing of
Django nor of the server's packages."""

import os
import subprocess
import sys

from tests.conftest import ROOT

CHECK = ("import execgo_client, execgo_client.cli, execgo_client.mcp_server, sys; "
         "assert not any(m.split('.')[0] in {'django','runs','runtime','approvals','execgo'} for m in sys.modules)")


def test_the_client_imports_nothing_of_the_server():
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env={**env, "PYTHONPATH": "client"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
