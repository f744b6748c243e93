"""The seam between the harness and the execution data plane (``runtime``):
"execute this step attempt on this host, give me its envelope".

The harness decides which host may run a step (routing by capability) and
holds a resource-ledger reservation around every launch; ``runtime`` knows
nothing of runs.
"""

import os
import re
import secrets
import time
from collections.abc import Callable

from django.conf import settings

from runs.models import Step
from runtime import attach, executor, launcher, layout, ledger, shim, watcher
from runtime.capabilities import capability_manifest, host_name
from runtime.envelopes import EnvelopeError, error_envelope, failed_result
from runtime.forkserver import ShimLink
from runtime.models import HostCapacity
from runtime.plan_resolver import SANDBOX_KEYS, resolve_plan

DEFAULT_QUEUE = "celery"
SANDBOX_QUEUE = "execgo.linux_sandbox"


def current_host() -> str:
    return host_name()


def host_queue(host: str) -> str:
    """The queue only the workers of ``host`` consume (re-attaching shims)."""
    return f"execgo.host.{host}"


def new_handle_id(step: Step, attempt: int) -> str:
    # Unique across database resets too: a handle names a directory on disk.
    return f"h-{step.pk}-{attempt}-{secrets.token_hex(3)}"


_ATTEMPT_HANDLE = re.compile(r"^h-(\d+)-\d+-[0-9a-f]+$")


def handle_step_pk(handle_id: str) -> int | None:
    """The step a ``new_handle_id`` handle names, else None."""
    match = _ATTEMPT_HANDLE.match(handle_id)
    return int(match[1]) if match else None


def can_sandbox(manifest: dict | None = None) -> bool:
    manifest = manifest or capability_manifest()
    return bool((manifest.get("bubblewrap") or {}).get("available"))


# What a plan needs of a host: bubblewrap for linux_sandbox, pasta for the
# internet network, the shim's own namespaces for a contained process profile.
CAPABILITIES = ("bubblewrap", "pasta", "namespaces")


def plan_needs(plan: dict) -> frozenset[str]:
    """The host capabilities without which ``plan`` would run weaker."""
    needs = set()
    if plan.get("profile") == "linux_sandbox":
        needs.add("bubblewrap")
    elif plan.get("profile") == "process" and plan.get("namespaces"):
        needs.add("namespaces")
    if plan.get("network") == "internet":
        needs.add("pasta")
    return frozenset(needs)


def host_capabilities(manifest: dict | None = None) -> frozenset[str]:
    manifest = manifest or capability_manifest()
    namespaces = manifest.get("namespaces") or {}
    has = {"bubblewrap": can_sandbox(manifest), "pasta": bool((manifest.get("pasta") or {}).get("available")),
           "namespaces": bool((manifest.get("user") or {}).get("is_root") and namespaces.get("mount")
                              and namespaces.get("net"))}
    return frozenset(name for name, present in has.items() if present)


def capability_queue(needs: frozenset[str]) -> str:
    """The queue of the hosts that have every capability in ``needs``
    (bubblewrap alone keeps the sandbox queue's name)."""
    if not needs:
        return DEFAULT_QUEUE
    if needs == {"bubblewrap"}:
        return SANDBOX_QUEUE
    return "execgo.needs." + "+".join(name for name in CAPABILITIES if name in needs)


def capability_queues(capabilities: frozenset[str]) -> list[str]:
    """Every capability queue a host with ``capabilities`` consumes: one per
    subset of them (at most eight)."""
    names = [name for name in CAPABILITIES if name in capabilities]
    subsets = [frozenset(name for bit, name in enumerate(names) if mask >> bit & 1) for mask in range(1, 1 << len(names))]
    return [capability_queue(subset) for subset in subsets]


def queue_for(step: Step) -> str:
    """Where a step may run: on a host that can honour the plan the policy
    rated for it (``Step.rated_plan``), so that no host runs it weaker; a
    step rated before plans were bound: a strict linux_sandbox step only on
    a host that has the sandbox, everything else anywhere."""
    if step.rated_plan:
        return capability_queue(plan_needs(step.rated_plan))
    requested = step.requested_plan or {}
    if requested.get("profile") == "linux_sandbox" and requested.get("mode") == "strict":
        return SANDBOX_QUEUE
    return DEFAULT_QUEUE


def bind_rated_plans(run_id: int, decision: dict, *, steps: list[Step] | None = None) -> None:
    """Each shell step keeps the effective plan the policy rated it on
    (``Step.rated_plan``): it runs only on a host that gives it that plan or
    a stronger one (``queue_for`` and ``weaker_than_rated``). ``steps``: the
    run's, when the caller has them (set on them too), else read."""
    if steps is None:
        steps = list(Step.objects.filter(run_id=run_id).only("pk", "step_id"))
    bind_rated_plans_of(steps, decision)


def bind_rated_plans_of(steps: list[Step], decision: dict) -> None:
    """``bind_rated_plans`` for these steps (copies an approver edited, say):
    set on them and stored."""
    plans = {row["id"]: row.get("rated_plan") for row in decision["steps"]}
    bound = [step for step in steps if plans.get(step.step_id)]
    for step in bound:
        step.rated_plan = plans[step.step_id]
    if len(bound) == 1:  # most plans: a plain UPDATE, not bulk_update's CASE over the ids
        Step.objects.filter(pk=bound[0].pk).update(rated_plan=bound[0].rated_plan)
    else:
        Step.objects.bulk_update(bound, ["rated_plan"])


def rated_part(plan: dict) -> dict:
    """What of an effective plan decides what a step can reach, without the
    host's name or the uid's number (which differ from host to host and do
    not change what it can reach): the part an approval binds to."""
    uid = plan.get("uid")
    return {"profile": plan.get("profile"), "namespaces": bool(plan.get("namespaces")),
            "network": plan.get("network"), "filesystem": plan.get("filesystem"),
            "readonly_paths": plan.get("readonly_paths") or [],
            "uid": None if uid is None else (0 if uid == 0 else "own"), "limits": plan.get("limits") or {},
            "downgrades": plan.get("downgrades") or []}


def best_plan(step: Step) -> dict:
    """The plan the policy rates ``step`` on: this host's effective plan, or,
    when this host would downgrade it, the strongest one a host seen lately
    would give it (the step is then routed there by ``queue_for``), so a
    default step is contained as well as the deployment can contain it.
    Raises EnvelopeError as ``resolve_step_plan`` does."""
    own = resolve_step_plan(step)
    if not own.get("downgrades"):
        return own
    best = own
    recent = time.time() - HOST_SEEN_WITHIN_S
    for row in HostCapacity.objects.exclude(host=current_host()).only("host", "capabilities", "last_seen"):
        if row.last_seen is None or row.last_seen.timestamp() < recent:
            continue
        try:
            plan = resolve_step_plan(step, manifest=row.capabilities or {})
        except EnvelopeError:
            continue
        if plan_strength(plan) > plan_strength(best):
            best = plan
    return best


def plan_strength(plan: dict) -> tuple[int, int, int, int]:
    return (_profile_strength(plan), _NETWORK_STRENGTH.get(plan.get("network"), 0),
            int(plan.get("filesystem") == "workspace"), int(plan.get("uid") not in (None, 0)))


# A host seen this lately (its worker's start, or a ledger heal every few
# seconds) is taken to be up.
HOST_SEEN_WITHIN_S = 120.0

# How contained each value of a plan's field is: higher is stronger.
_NETWORK_STRENGTH = {"none": 2, "loopback": 2, "internet": 1}


def _profile_strength(plan: dict) -> int:
    if plan.get("profile") == "linux_sandbox":
        return 2
    return 1 if plan.get("profile") == "process" and plan.get("namespaces") else 0


def weaker_than_rated(plan: dict, rated: dict) -> list[str]:
    """How the effective ``plan`` this host would run is weaker than the one
    the policy rated (and a human may have approved): empty when it is not."""
    if not rated:
        return []
    weaker = []
    if _profile_strength(plan) < _profile_strength(rated):
        weaker.append(f"profile {plan.get('profile')}{' without namespaces' if plan.get('profile') == 'process' else ''}"
                      f" instead of {rated.get('profile')}")
    if _NETWORK_STRENGTH.get(plan.get("network"), 0) < _NETWORK_STRENGTH.get(rated.get("network"), 0):
        weaker.append(f"network {plan.get('network')} instead of {rated.get('network')}")
    if plan.get("filesystem") != "workspace" and rated.get("filesystem") == "workspace":
        weaker.append(f"filesystem {plan.get('filesystem')} instead of the workspace")
    elif unrated := sorted(set(plan.get("readonly_paths") or []) - set(rated.get("readonly_paths") or [])):
        weaker.append(f"host paths {', '.join(unrated)} readable, which were not rated")
    if rated.get("seccomp") and not plan.get("seccomp"):
        weaker.append("no system-call filter")
    if rated.get("uid") not in (None, 0) and plan.get("uid") in (None, 0):
        weaker.append("the worker's own uid instead of a uid of its own")
    for name, limit in (rated.get("limits") or {}).items():
        have = (plan.get("limits") or {}).get(name)
        if limit is not None and (have is None or have > limit):
            weaker.append(f"limit {name} {have} instead of {limit}")
    return weaker


def resolve_step_plan(step: Step, *, manifest: dict | None = None) -> dict:
    """The effective plan on this host (or on one with ``manifest``);
    raises EnvelopeError when a strict request cannot be honoured there."""
    requested = step.requested_plan or {}
    return resolve_plan({key: requested[key] for key in SANDBOX_KEYS if key in requested},
                        mode=requested.get("mode"), uid_key=step.pk, manifest=manifest)


def routed_plan(step: Step) -> dict | None:
    """For a step only sandbox hosts run (see ``queue_for``): the plan it
    gets there, resolved as if this host had bubblewrap. None otherwise."""
    if queue_for(step) != SANDBOX_QUEUE:
        return None
    manifest = capability_manifest()
    manifest["bubblewrap"] = {**(manifest.get("bubblewrap") or {}), "available": True}
    manifest["seccomp"] = {**(manifest.get("seccomp") or {}), "available": True}  # it comes with bubblewrap there
    return resolve_step_plan(step, manifest=manifest)


def _reserve(host: str, handle_id: str, amounts: dict) -> bool:
    if ledger.reserve(host, handle_id, **amounts):
        return True
    # Workers register their host at start; a process that executes steps
    # without having started as a worker (a management command, a test)
    # registers on first use.
    if not HostCapacity.objects.filter(host=host).exists():
        ledger.host_register(host)
        return ledger.reserve(host, handle_id, **amounts)
    return False


def reserve_slot(step: Step) -> bool:
    """Reserve the step's slot on this host if one is free now (never waits)."""
    return _reserve(current_host(), step.handle_id, reservation_amounts(step))


def wait_for_slot(step: Step) -> None:
    """Wait at most EXECGO_LEDGER_WAIT_S for the step's slot; raises a
    retryable ``timeout`` EnvelopeError then (the caller re-queues), or
    ``invalid_input`` when the step can never fit this host."""
    ledger.wait_for_reservation(current_host(), step.handle_id, **reservation_amounts(step))


def reclaim_reservations(in_flight: Callable) -> list[dict]:
    """This host's reservations whose worker process is gone, given back."""
    return ledger.reclaim(current_host(), in_flight=in_flight)


def reservation_amounts(step: Step) -> dict:
    """A slot, and the memory and processes the step itself asked for. The
    default limits every step gets are guards, not declarations: 8 GiB of
    address space is no estimate of what ``true`` uses, and reserving it
    would let a 24 GiB host run three steps at a time."""
    effective = (step.effective_plan or {}).get("limits") or {}
    asked = ((step.requested_plan or {}).get("limits") or {}) if isinstance(step.requested_plan, dict) else {}

    def declared(name: str) -> int:
        return int(effective.get(name) or 0) if asked.get(name) is not None else 0

    return {"slots": 1, "memory_bytes": declared("address_space_bytes"), "pids": declared("processes")}


def hand_over_reservation(from_handle: str, step: Step) -> bool:
    """Pass a finished step's slot to the next step this worker runs."""
    return ledger.transfer(from_handle, step.handle_id, host=current_host(), **reservation_amounts(step))


def release_reservation(handle_id: str, *, only_mine: bool = False) -> None:
    ledger.release(handle_id, only_mine=only_mine)


def warm_shim(step: Step, *, following: Step | None = None, handle_id: str = "", plan: dict | None = None
              ) -> ShimLink | None:
    """A shim forked ahead for the step that follows ``step`` on this
    worker: ``following``, when it is known that it will be started as
    ``handle_id`` with ``plan`` (``runs.settle.Forecast``), its sandbox
    pre-started there too; else assuming the same isolation as ``step``. A
    spare that does not fit the step that comes goes unused."""
    if following is None or plan is None:
        return launcher.warm_shim(step.effective_plan or {})
    preset = launcher.sandbox_preset(handle_id, tool=following.tool, params=following.params, plan=plan)
    return launcher.warm_shim(plan, preset=preset)


def run_tool(step: Step, *, attempt: int, timeout_s: float, cancel_requested: Callable[[], bool],
             on_progress: Callable[[int, str], None], spare: ShimLink | None = None,
             while_running: Callable[[], None] | None = None) -> dict | None:
    """Execute a step that holds its slot on this host (in ``spare``, a
    ``warm_shim``, when it fits). The caller reserved the slot before
    claiming the attempt and releases it once the result is recorded.
    ``while_running``: called once a shell step's shim (or an http step's
    process) is started. None: such a step still running after
    EXECGO_STEP_HAND_OFF_S was handed to this worker's watcher, with its
    slot (``hand_to_watcher``)."""
    return executor.execute(step.handle_id, tool=step.tool, params=step.params, timeout_s=timeout_s,
                            attempt=attempt, plan=step.effective_plan, cancel_requested=cancel_requested,
                            on_progress=on_progress, spare=spare, while_running=while_running,
                            **_hand_off(step, attempt))


def _hand_off(step: Step, attempt: int) -> dict:
    if settings.EXECGO_STEP_HAND_OFF_S < 0:
        return {}
    return {"hand_off": lambda info, progress_offset: hand_to_watcher(step, attempt, info, progress_offset),
            "hand_off_after_s": settings.EXECGO_STEP_HAND_OFF_S}


def hand_to_watcher(step: Step, attempt: int, info: dict | None, progress_offset: int) -> bool:
    """Give the waiting for ``step``'s running attempt to the watcher of
    this pool process's worker (``runtime.watcher``), and its reservation
    with it: the slot stays taken, by the worker's main process, until the
    result is recorded. False when no watcher took it."""
    ref = {"step": step.pk, "attempt": attempt, "run": step.run_id}
    if not watcher.hand_off(step.handle_id, ref=ref, info=info, progress_offset=progress_offset):
        return False
    # After the hand-off: a pool process killed in between leaves a slot
    # the heal reclaims and a re-attachment hands over again (the watcher
    # ignores the second); a result recorded in between already released it.
    ledger.hand_over(step.handle_id, os.getppid())
    return True


LOG_STREAMS = {"stdout": shim.STDOUT_FILE, "stderr": shim.STDERR_FILE}


def step_log_path(step: Step, stream: str):
    """The log file of the step's latest attempt, or None once it is gone."""
    if stream not in LOG_STREAMS or not step.handle_id:
        return None
    path = layout.task_dir(step.handle_id) / LOG_STREAMS[stream]
    return path if path.is_file() else None


def read_result(step: Step) -> dict | None:
    """The result envelope the step's current attempt left, if it has ended."""
    return attach.read_result(step.handle_id)


def reattach(step: Step, *, cancel_requested: Callable[[], bool], on_progress: Callable[[int, str], None]
             ) -> dict | None:
    """Wait for a shim a previous worker started (None: handed to this
    worker's watcher, as in ``run_tool``); a shim that is gone
    without a result yields an ``internal`` error envelope. So does an
    attempt whose worker died between claiming and preparing it (retryable:
    nothing ran, and said so in ``details.started``)."""
    try:
        return attach.wait(step.handle_id, cancel_requested=cancel_requested, on_progress=on_progress,
                           **_hand_off(step, step.attempt))
    except EnvelopeError as exc:
        error = error_envelope("internal", f"the attempt was claimed but never started: {exc.envelope['message']}",
                               retryable=True, details={"handle_id": step.handle_id, "started": False})
        started = step.started_at.timestamp() if step.started_at else time.time()
        return failed_result(step.handle_id, error, attempt=step.attempt, started_at=started)

