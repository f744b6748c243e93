"""The capability probe describes this host as it is."""

import json
import os
import shutil
import subprocess

import pytest

from runtime.capabilities import capability_manifest
from tests.runtime.conftest import SYSTEM_PYTHON


def test_manifest_is_json_and_cached(manifest):
    assert json.loads(json.dumps(manifest)) == manifest
    assert capability_manifest() == manifest
    manifest_copy = capability_manifest()
    manifest_copy["cpu"]["logical"] = -1
    assert capability_manifest()["cpu"]["logical"] > 0  # callers cannot corrupt the cache


def test_user_and_resources(manifest):
    assert manifest["user"]["euid"] == os.geteuid()
    assert manifest["user"]["is_root"] == (os.geteuid() == 0)
    assert manifest["cpu"]["logical"] == os.cpu_count()
    assert manifest["memory"]["total_bytes"] > 0


def test_bubblewrap_matches_reality(manifest):
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        assert manifest["bubblewrap"]["available"] is False
        return
    runs = subprocess.run([bwrap, "--ro-bind", "/", "/", "--unshare-all", "true"], check=False).returncode == 0
    assert manifest["bubblewrap"]["path"] == bwrap
    assert manifest["bubblewrap"]["available"] == runs


def test_pid_namespace_matches_reality(manifest):
    unshare = shutil.which("unshare")
    if unshare and os.geteuid() == 0:
        works = subprocess.run([unshare, "--pid", "--fork", "true"], check=False).returncode == 0
        assert manifest["pid_namespace"]["available"] == works
    elif os.geteuid() != 0:
        assert manifest["pid_namespace"]["available"] is False


def test_cgroup_section_matches_mounts(manifest):
    mounts = open("/proc/self/mountinfo").read()
    assert manifest["cgroup"]["v2_mounted"] == (" - cgroup2 " in mounts)
    for controller in manifest["cgroup"]["delegated"]:
        assert controller in manifest["cgroup"]["v2_controllers"]


def test_rlimits_probe_ran(manifest):
    assert manifest["rlimits"]["enforced"] is True
    assert manifest["rlimits"]["nproc_enforced"] == (os.geteuid() != 0 or manifest["user"]["sandbox_uid"] is not None)


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="outside CI the suite may run unprivileged")
def test_ci_has_what_the_containment_tests_need_so_none_of_them_skips():
    """CI is where containment is proven: there, the escape suite, the
    hardening and the filesystem tests must not skip for want of root,
    bubblewrap, its system call filter, pasta or the system Python."""
    manifest = capability_manifest(refresh=True)
    assert os.geteuid() == 0
    for capability in ("bubblewrap", "seccomp", "pasta"):
        assert manifest[capability]["available"], (capability, manifest[capability])
    assert os.access(SYSTEM_PYTHON, os.X_OK), SYSTEM_PYTHON
