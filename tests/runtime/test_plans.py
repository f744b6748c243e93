"""The execution-plan resolver: strict refuses, adaptive downgrades and says so."""

import copy

import pytest

from runtime.envelopes import EnvelopeError
from runtime.plan_resolver import resolve_plan

ROOT_HOST = {
    "host": {"name": "h1"},
    "user": {"euid": 0, "is_root": True, "sandbox_uid": 65534},
    "pid_namespace": {"available": True},
    "rlimits": {"enforced": True, "nproc_enforced": True},
    "bubblewrap": {"available": True, "path": "/usr/bin/bwrap"},
}


def host(**changes):
    manifest = copy.deepcopy(ROOT_HOST)
    for key, value in changes.items():
        manifest[key] = value
    return manifest


def test_default_plan_is_process_with_defaults():
    plan = resolve_plan(None, mode="strict", manifest=host())
    assert plan["profile"] == "process"
    assert plan["limits"]["open_files"] == 1024
    assert plan["limits"]["cpu_seconds"] is None
    assert plan["uid"] is None
    assert plan["tree_kill"] == "pid_namespace"
    assert plan["downgrades"] == []


def test_linux_sandbox_as_root_drops_to_the_sandbox_uid():
    plan = resolve_plan({"profile": "linux_sandbox"}, mode="strict", manifest=host())
    assert plan["profile"] == "linux_sandbox"
    assert (plan["uid"], plan["gid"]) == (65534, 65534)
    assert plan["network"] == "none"


def test_processes_limit_as_root_drops_privileges():
    plan = resolve_plan({"limits": {"processes": 50}}, mode="strict", manifest=host())
    assert plan["uid"] == 65534
    assert plan["limits"]["processes"] == 50


def test_processes_limit_as_root_without_uid_drop():
    no_drop = host(user={"euid": 0, "is_root": True, "sandbox_uid": None})
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan({"limits": {"processes": 50}}, mode="strict", manifest=no_drop)
    assert refused.value.code == "denied"
    plan = resolve_plan({"limits": {"processes": 50}}, mode="adaptive", manifest=no_drop)
    assert plan["limits"]["processes"] is None
    assert plan["downgrades"][0]["what"] == "limits.processes"


def test_non_root_keeps_its_uid():
    plan = resolve_plan(
        {"profile": "linux_sandbox", "limits": {"processes": 5}},
        mode="strict",
        manifest=host(user={"euid": 1000, "is_root": False, "sandbox_uid": None}),
    )
    assert plan["uid"] is None
    assert plan["limits"]["processes"] == 5


def test_unenforced_rlimits():
    manifest = host(rlimits={"enforced": False})
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan({"limits": {"cpu_seconds": 3}}, mode="strict", manifest=manifest)
    assert refused.value.code == "denied"
    plan = resolve_plan({"limits": {"cpu_seconds": 3}}, mode="adaptive", manifest=manifest)
    assert plan["limits"]["cpu_seconds"] is None
    assert {d["what"] for d in plan["downgrades"]} == {"limits.cpu_seconds", "limits.open_files"}


def test_no_pid_namespace_means_process_scan():
    plan = resolve_plan(None, mode="strict", manifest=host(pid_namespace={"available": False}))
    assert plan["tree_kill"] == "process_scan"


@pytest.mark.parametrize("mode", ["strict", "adaptive"])
@pytest.mark.parametrize(
    "requested",
    [
        {"limits": {"cpu_seconds": -1}},
        {"limits": {"cpu_seconds": 0}},
        {"limits": {"address_space_bytes": 1024}},
        {"limits": {"open_files": 2.5}},
        {"limits": {"processes": True}},
        {"limits": {"processes": "10"}},
        {"limits": {"memory": 10}},
        {"limits": [1, 2]},
        {"profile": "docker"},
        {"sandbox": "x"},
    ],
)
def test_nonsense_is_invalid_input_in_both_modes(requested, mode):
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan(requested, mode=mode, manifest=host())
    assert refused.value.code == "invalid_input"


def test_cpu_seconds_round_up_to_whole_seconds():
    plan = resolve_plan({"limits": {"cpu_seconds": 1.2}}, mode="strict", manifest=host())
    assert plan["limits"]["cpu_seconds"] == 2


def test_unknown_mode_is_invalid():
    with pytest.raises(EnvelopeError):
        resolve_plan(None, mode="lenient", manifest=host())
