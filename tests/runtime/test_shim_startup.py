"""The shim stays cheap to start and the data plane stays out of the kernel."""

import ast
import json
import subprocess
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
HEAVY = {"json", "re", "enum", "subprocess", "signal", "django", "psutil", "ctypes", "socket", "threading"}


def test_shim_imports_only_cheap_modules():
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import shim; " "sys.stdout.write(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe, str(RUNTIME)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert HEAVY.isdisjoint(out), HEAVY.intersection(out)


def test_shim_probe_reports_json():
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(RUNTIME / "shim.py"), "--probe"], capture_output=True, text=True, check=True
    ).stdout
    report = json.loads(out)
    assert set(report) >= {"pid_namespace", "rlimits", "euid"}


def test_runtime_never_imports_the_kernel_or_approvals():
    offenders = []
    for path in RUNTIME.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("runs", "approvals")]
    assert offenders == []
