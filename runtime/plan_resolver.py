"""Execution-plan resolver: a step's requested sandbox vs what the host can do.

``resolve_plan`` runs before anything executes. The requested sandbox is
``{"profile": "process" | "linux_sandbox", "limits": {...}}``; the result is
the *effective plan*, a JSON dict stored with the step and handed to the
executor unchanged.

- ``strict`` refuses what cannot be honoured: ``denied`` when the host lacks
  a mechanism (no working bubblewrap, rlimits not enforced, RLIMIT_NPROC for
  a root worker that may not drop privileges), ``invalid_input`` for limits
  that make no sense.
- ``adaptive`` runs anyway with the closest weaker setting and lists every
  such change in ``plan["downgrades"]`` (what, requested, effective, why).
  Nonsense limits are refused in both modes.

Profiles:
- ``process``: rlimits, own session and process group, the whole tree
  killed on timeout/cancel (PID namespace when available, else a /proc scan).
  Runs with the worker's uid, except that a root worker drops to the sandbox
  uid when a ``processes`` limit is asked for (the kernel does not apply
  RLIMIT_NPROC to root).
- ``linux_sandbox``: the same, inside bubblewrap (see runtime/sandbox.py):
  read-only host, private /tmp, workspace read-write, no network, no
  capabilities, cleared environment, sandbox uid when the worker is root.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from django.conf import settings

from runtime.capabilities import capability_manifest, sandbox_uid
from runtime.envelopes import EnvelopeError

PROFILES = ("process", "linux_sandbox")
MODES = ("strict", "adaptive")
MIB = 1024 * 1024

# name -> (smallest sensible value, largest accepted value)
LIMIT_BOUNDS: dict[str, tuple[int, int]] = {
    "cpu_seconds": (1, 7 * 24 * 3600),
    # Below this even /bin/sh (or bubblewrap) cannot be mapped, so every
    # step would fail at exec instead of hitting the limit it asked for.
    "address_space_bytes": (16 * MIB, 1 << 50),
    "file_size_bytes": (1, 1 << 50),
    "open_files": (16, 1 << 20),
    "processes": (1, 1 << 22),
    "log_cap_bytes": (0, 1 << 40),
}


def default_limits() -> dict[str, int | None]:
    return dict(settings.EXECGO_DEFAULT_LIMITS)


def _invalid(message: str, **details: Any) -> EnvelopeError:
    return EnvelopeError.of("invalid_input", message, source="executor", details=details)


def _denied(message: str, **details: Any) -> EnvelopeError:
    return EnvelopeError.of("denied", message, source="executor", details=details)


def normalize_limits(requested: Any) -> dict[str, int | None]:
    """Defaults merged with the requested limits; nonsense raises invalid_input."""
    if requested is None:
        requested = {}
    if not isinstance(requested, Mapping):
        raise _invalid("limits must be an object")
    unknown = sorted(set(requested) - set(LIMIT_BOUNDS))
    if unknown:
        raise _invalid(f"unknown limits: {', '.join(unknown)}", unknown=unknown, known=sorted(LIMIT_BOUNDS))
    limits = default_limits()
    for name, value in requested.items():
        if value is None:
            limits[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _invalid(f"limit {name} must be a number", limit=name, value=repr(value))
        if name == "cpu_seconds":
            value = math.ceil(value)  # RLIMIT_CPU counts whole seconds
        elif value != int(value):
            raise _invalid(f"limit {name} must be a whole number", limit=name, value=value)
        low, high = LIMIT_BOUNDS[name]
        if not low <= value <= high:
            raise _invalid(f"limit {name}={value} is outside [{low}, {high}]", limit=name, value=value)
        limits[name] = int(value)
    return limits


def resolve_plan(
    requested: Mapping[str, Any] | None = None,
    *,
    mode: str | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    requested = dict(requested or {})
    unknown = sorted(set(requested) - {"profile", "limits"})
    if unknown:
        raise _invalid(f"unknown sandbox fields: {', '.join(unknown)}", unknown=unknown)
    mode = mode or settings.EXECGO_SANDBOX_MODE
    if mode not in MODES:
        raise _invalid(f"mode must be one of {', '.join(MODES)}", mode=mode)
    profile = requested.get("profile") or "process"
    if profile not in PROFILES:
        raise _invalid(f"profile must be one of {', '.join(PROFILES)}", profile=profile)
    limits = normalize_limits(requested.get("limits"))
    manifest = manifest if manifest is not None else capability_manifest()

    downgrades: list[dict[str, Any]] = []
    notes: list[str] = []

    def downgrade(what: str, wanted: Any, effective: Any, reason: str) -> None:
        if mode == "strict":
            raise _denied(f"cannot honour {what}={wanted!r}: {reason}", what=what, requested=wanted, reason=reason)
        downgrades.append({"what": what, "requested": wanted, "effective": effective, "reason": reason})

    bubblewrap = manifest.get("bubblewrap") or {}
    effective_profile = profile
    if profile == "linux_sandbox" and not bubblewrap.get("available"):
        reason = bubblewrap.get("error") or "bubblewrap is not available"
        downgrade("profile", "linux_sandbox", "process", f"bubblewrap unusable on this host: {reason}")
        effective_profile = "process"

    rlimits = manifest.get("rlimits") or {}
    asked = {name: value for name, value in limits.items() if value is not None and name != "log_cap_bytes"}
    if asked and not rlimits.get("enforced"):
        for name, value in sorted(asked.items()):
            downgrade(f"limits.{name}", value, None, "rlimits are not enforced on this host")
            limits[name] = None

    user = manifest.get("user") or {}
    is_root = bool(user.get("is_root"))
    drop_to = user.get("sandbox_uid", sandbox_uid()) if is_root else None
    uid = None
    if is_root and effective_profile == "linux_sandbox" and drop_to is not None:
        uid = drop_to
    if is_root and limits["processes"] is not None:
        if drop_to is not None:
            uid = drop_to
            notes.append(f"runs as uid {drop_to}: the kernel does not apply RLIMIT_NPROC to root")
        else:
            downgrade("limits.processes", limits["processes"], None, "RLIMIT_NPROC is not enforced for root")
            limits["processes"] = None

    pid_namespace = (manifest.get("pid_namespace") or {}).get("available")
    tree_kill = "pid_namespace" if pid_namespace else "process_scan"
    if not pid_namespace:
        notes.append("no PID namespace: descendants are tracked by /proc scan and environment marker")

    sandboxed = effective_profile == "linux_sandbox"
    return {
        "profile": effective_profile,
        "requested_profile": profile,
        "mode": mode,
        "limits": limits,
        "uid": uid,
        "gid": uid,
        "tree_kill": tree_kill,
        "network": "none" if sandboxed else "host",
        "filesystem": "read_only_host_workspace_rw" if sandboxed else "host",
        "downgrades": downgrades,
        "notes": notes,
        "host": (manifest.get("host") or {}).get("name"),
    }
