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
    "seccomp": {"available": True},
    "namespaces": {"mount": True, "net": True},
}


@pytest.fixture(autouse=True)
def sandbox_uids(settings):
    settings.EXECGO_SANDBOX_UID = 1_000_000
    settings.EXECGO_SANDBOX_UID_COUNT = 1000


def host(**changes):
    manifest = copy.deepcopy(ROOT_HOST)
    for key, value in changes.items():
        manifest[key] = value
    return manifest


def test_default_plan_is_the_strongest_profile_with_defaults():
    plan = resolve_plan(None, mode="strict", manifest=host(), uid_key=7)
    assert plan["profile"] == "linux_sandbox"
    assert plan["requested_profile"] is None
    assert (plan["network"], plan["filesystem"]) == ("none", "workspace")
    assert plan["limits"]["open_files"] == 1024
    assert plan["limits"]["processes"] == 256
    assert plan["limits"]["workspace_bytes"] == 1024**3
    assert plan["uid"] == 1_000_007
    assert plan["tree_kill"] == "pid_namespace"
    assert plan["downgrades"] == []


def test_without_bubblewrap_the_default_falls_back_even_in_strict_mode_and_says_so():
    manifest = host(bubblewrap={"available": False, "error": "bwrap not installed"})
    plan = resolve_plan(None, mode="strict", manifest=manifest, uid_key=7)
    assert (plan["profile"], plan["namespaces"], plan["network"], plan["filesystem"]) == (
        "process", True, "none", "workspace")
    assert plan["downgrades"][0]["what"] == "profile"
    assert "bwrap not installed" in plan["downgrades"][0]["reason"]


def test_a_host_that_cannot_contain_refuses_in_strict_and_reaches_the_host_in_adaptive():
    manifest = host(bubblewrap={"available": False, "error": "none"}, namespaces={"mount": False, "net": False})
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan(None, mode="strict", manifest=manifest)
    assert refused.value.code == "denied"
    assert "network" in refused.value.envelope["message"]
    plan = resolve_plan(None, mode="adaptive", manifest=manifest)
    assert (plan["network"], plan["filesystem"]) == ("host", "host")
    assert {d["what"] for d in plan["downgrades"]} == {"profile", "network", "limits.workspace_bytes"}


def test_each_step_gets_its_own_uid_from_the_range():
    uids = {resolve_plan(None, manifest=host(), uid_key=key)["uid"] for key in range(5)}
    assert uids == {1_000_000, 1_000_001, 1_000_002, 1_000_003, 1_000_004}
    assert resolve_plan(None, manifest=host(), uid_key=1007)["uid"] == 1_000_007
    drawn = resolve_plan(None, manifest=host())["uid"]
    assert 1_000_000 <= drawn < 1_001_000


def test_internet_without_an_isolated_nat_is_the_host_network_recorded():
    plan = resolve_plan({"network": "internet"}, mode="adaptive", manifest=host())
    assert plan["network"] == "host"
    assert plan["requested_network"] == "internet"
    assert plan["downgrades"][0]["what"] == "network"
    with pytest.raises(EnvelopeError):
        resolve_plan({"network": "internet"}, mode="strict", manifest=host())


@pytest.mark.parametrize("requested", [{"limits": {"processes": 5000}}, {"limits": {"processes": None}},
                                       {"network": "everywhere"}])
def test_limits_above_their_cap_or_lifted_and_unknown_networks_are_invalid(requested):
    with pytest.raises(EnvelopeError) as refused:
        resolve_plan(requested, mode="adaptive", manifest=host())
    assert refused.value.code == "invalid_input"


def test_processes_limit_as_root_without_uid_drop(settings):
    no_drop = host()
    settings.EXECGO_SANDBOX_UID = None
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
    assert {d["what"] for d in plan["downgrades"]} == {
        "limits.cpu_seconds", "limits.open_files", "limits.address_space_bytes", "limits.file_size_bytes",
        "limits.processes"}


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
