"""The seam between the harness and the execution data plane (``runtime``):
"execute this step attempt on this host, give me its envelope".

The harness decides which host may run a step (routing by capability) and
holds a resource-ledger reservation around every launch; ``runtime`` knows
nothing of runs.
"""

import secrets
import time
from collections.abc import Callable

from runs.models import Step
from runtime import attach, executor, launcher, layout, ledger, shim
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


def can_sandbox(manifest: dict | None = None) -> bool:
    manifest = manifest or capability_manifest()
    return bool((manifest.get("bubblewrap") or {}).get("available"))


def queue_for(step: Step) -> str:
    """Where a step may run: a strict linux_sandbox step only on a host that
    has the sandbox; everything else anywhere."""
    requested = step.requested_plan or {}
    if requested.get("profile") == "linux_sandbox" and requested.get("mode") == "strict":
        return SANDBOX_QUEUE
    return DEFAULT_QUEUE


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
    ``handle_id`` with ``plan`` (``runs.execution.Forecast``), its sandbox
    pre-started there too; else assuming the same isolation as ``step``. A
    spare that does not fit the step that comes goes unused."""
    if following is None or plan is None:
        return launcher.warm_shim(step.effective_plan or {})
    preset = launcher.sandbox_preset(handle_id, tool=following.tool, params=following.params, plan=plan)
    return launcher.warm_shim(plan, preset=preset)


def run_tool(step: Step, *, attempt: int, timeout_s: float, cancel_requested: Callable[[], bool],
             on_progress: Callable[[int, str], None], spare: ShimLink | None = None,
             while_running: Callable[[], None] | None = None) -> dict:
    """Execute a step that holds its slot on this host (in ``spare``, a
    ``warm_shim``, when it fits). The caller reserved the slot before
    claiming the attempt and releases it once the result is recorded.
    ``while_running``: called once a shell step's shim is started."""
    return executor.execute(step.handle_id, tool=step.tool, params=step.params, timeout_s=timeout_s,
                            attempt=attempt, plan=step.effective_plan, cancel_requested=cancel_requested,
                            on_progress=on_progress, spare=spare, while_running=while_running)


LOG_STREAMS = {"stdout": shim.STDOUT_FILE, "stderr": shim.STDERR_FILE}


def step_log_path(step: Step, stream: str):
    """The log file of the step's latest attempt, or None once it is gone."""
    if stream not in LOG_STREAMS or not step.handle_id:
        return None
    path = layout.task_dir(step.handle_id) / LOG_STREAMS[stream]
    return path if path.is_file() else None


def reattach(step: Step, *, cancel_requested: Callable[[], bool], on_progress: Callable[[int, str], None]) -> dict:
    """Wait for a shim a previous worker started; a shim that is gone
    without a result yields an ``internal`` error envelope. So does an
    attempt whose worker died between claiming and preparing it (retryable:
    nothing ran, and said so in ``details.started``)."""
    try:
        return attach.wait(step.handle_id, cancel_requested=cancel_requested, on_progress=on_progress)
    except EnvelopeError as exc:
        error = error_envelope("internal", f"the attempt was claimed but never started: {exc.envelope['message']}",
                               retryable=True, details={"handle_id": step.handle_id, "started": False})
        started = step.started_at.timestamp() if step.started_at else time.time()
        return failed_result(step.handle_id, error, attempt=step.attempt, started_at=started)

