"""Execution-plan resolver: a step's requested sandbox vs what the host can do.

``resolve_plan`` runs before anything executes. The requested sandbox is
``{"profile": "linux_sandbox" | "process", "network": "none" | "loopback" |
"internet", "limits": {...}}``, every key optional; the result is the
*effective plan*, a JSON dict stored with the step, handed to the executor
unchanged and rated by the policy gate (what a step can reach sets its
baseline risk).

Contained by default: a step that names no profile gets the strongest this
host supports (``linux_sandbox`` where bubblewrap works, else ``process``,
the fallback recorded as a downgrade), no network, the default limits and,
on a root worker, its own unprivileged uid.

- ``strict`` refuses what cannot be honoured: ``denied`` when the host lacks
  a mechanism, ``invalid_input`` for limits that make no sense or exceed the
  caps (``EXECGO_LIMIT_CAPS``).
- ``adaptive`` runs anyway with the closest weaker setting and lists every
  such change in ``plan["downgrades"]`` (what, requested, effective, why);
  the weaker plan is rated by what it can reach (network "host" or
  filesystem "host" is high risk, so a human decides).

Profiles:
- ``linux_sandbox``: bubblewrap (see runtime/sandbox.py): only the host's
  system directories, read-only, with their secrets hidden, the workspace
  and the scratch directories sized tmpfs, every namespace unshared, no
  capabilities, cleared environment, and the seccomp filter of
  runtime/syscall_filter.py (``plan["seccomp"]``; a host that cannot apply
  it is a missing mechanism like the others: strict refuses, adaptive runs
  without it and records the downgrade).
- ``process``: on a root worker that can create namespaces, the shim gives
  the command a mount and network namespace of its own (every mount
  nosuid,nodev, the host's non-system top-level directories covered, the
  same hidden paths and sized tmpfs, no network) before dropping to the
  step's uid; otherwise the host's filesystem and network, contained only
  by file modes and the uid (or not at all on a worker that is not root).
  No seccomp filter, in the host's user namespace.

Every profile runs its command with no_new_privs: a setuid or
file-capability program gains nothing.

Filesystem: ``"workspace"`` is that minimal view, with only the workspace
and scratch directories writable; ``"readonly_paths"`` lists the host paths
the operator added to it (``EXECGO_SANDBOX_READONLY_PATHS``), which the
policy rates; ``"host"`` (only ever a downgrade) is the host's own.

Both: rlimits, own session and process group, the whole tree killed on
timeout/cancel (PID namespace when available, else a /proc scan).

Network: ``none`` and ``loopback`` give the step a namespace with nothing
but its own loopback; ``internet`` adds a user-mode NAT (pasta) with
the host's loopback cut off and the host's address the step's own; ``host`` (only ever a downgrade) is the
worker's own network, database and broker included.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

from django.conf import settings

from runtime.capabilities import capability_manifest, sandbox_uid
from runtime.envelopes import EnvelopeError
from runtime.sandbox import readonly_paths

PROFILES = ("process", "linux_sandbox")
MODES = ("strict", "adaptive")
NETWORKS = ("none", "loopback", "internet")
SANDBOX_KEYS = {"profile", "network", "limits"}
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
    "workspace_bytes": (1 * MIB, 1 << 50),
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
    caps = settings.EXECGO_LIMIT_CAPS
    for name, value in requested.items():
        if value is None:
            if caps.get(name) is not None:
                raise _invalid(f"limit {name} cannot be lifted: at most {caps[name]}", limit=name, cap=caps[name])
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
        if caps.get(name) is not None and value > caps[name]:
            raise _invalid(f"limit {name}={value} is above its cap {caps[name]}", limit=name, value=value,
                           cap=caps[name])
        limits[name] = int(value)
    return limits


def step_uid(key: int | None, manifest: Mapping[str, Any]) -> int | None:
    """The uid a step runs as: its own, from the sandbox range, on a root
    worker (None: the worker's uid). ``key`` (the step's id) spreads steps
    over the range; without one a random uid is drawn."""
    base = sandbox_uid() if (manifest.get("user") or {}).get("is_root") else None
    if base is None:
        return None
    count = max(1, int(settings.EXECGO_SANDBOX_UID_COUNT))
    offset = secrets.randbelow(count) if key is None else int(key) % count
    return int(base) + offset


def resolve_plan(
    requested: Mapping[str, Any] | None = None,
    *,
    mode: str | None = None,
    manifest: Mapping[str, Any] | None = None,
    uid_key: int | None = None,
) -> dict[str, Any]:
    """The effective plan of a step that asks for ``requested`` on a host
    described by ``manifest`` (see the module docstring); ``uid_key``: the
    step's id, which picks its uid (``step_uid``)."""
    requested = dict(requested or {})
    mode, profile, network = _checked_request(requested, mode)
    limits = normalize_limits(requested.get("limits"))
    manifest = manifest if manifest is not None else capability_manifest()
    downgrades = _Downgrades(mode)
    notes: list[str] = []
    uid = step_uid(uid_key, manifest)
    namespaces = manifest.get("namespaces") or {}
    # The shim's own namespaces need root (CAP_SYS_ADMIN) and the probe's word that they work.
    own_namespaces = (bool((manifest.get("user") or {}).get("is_root")) and bool(namespaces.get("mount"))
                      and bool(namespaces.get("net")))
    effective_profile, seccomp = _profile_on_host(profile, manifest, downgrades)
    contained = effective_profile == "linux_sandbox" or own_namespaces
    effective_network = _network_on_host(network, effective_profile, contained, manifest, downgrades)
    _limits_on_host(limits, contained=contained, uid=uid, manifest=manifest, downgrades=downgrades, notes=notes)
    try:
        extra_paths = readonly_paths() if contained else []
    except ValueError as exc:
        raise _invalid(f"EXECGO_SANDBOX_READONLY_PATHS: {exc}", setting="EXECGO_SANDBOX_READONLY_PATHS") from None
    pid_namespace = (manifest.get("pid_namespace") or {}).get("available")
    tree_kill = "pid_namespace" if pid_namespace else "process_scan"
    if not pid_namespace:
        notes.append("no PID namespace: descendants are tracked by /proc scan and environment marker")
    return {
        "profile": effective_profile,
        "requested_profile": profile,
        "mode": mode,
        "limits": limits,
        "uid": uid,
        "gid": uid,
        "tree_kill": tree_kill,
        "network": effective_network,
        "requested_network": network,
        "filesystem": "workspace" if contained else "host",
        # Host paths the step sees besides the system directories (see runtime/sandbox.py).
        "readonly_paths": extra_paths,
        # The shim's own mount and network namespaces (the process profile on a root worker).
        "namespaces": effective_profile == "process" and own_namespaces,
        # bubblewrap loads runtime.syscall_filter's program (linux_sandbox only).
        "seccomp": seccomp,
        "downgrades": downgrades.entries,
        "notes": notes,
        "host": (manifest.get("host") or {}).get("name"),
    }


def _checked_request(requested: Mapping[str, Any], mode: str | None) -> tuple[str, str | None, str]:
    """The request's mode, profile and network -> invalid_input for any
    unknown field or value."""
    unknown = sorted(set(requested) - SANDBOX_KEYS)
    if unknown:
        raise _invalid(f"unknown sandbox fields: {', '.join(unknown)}", unknown=unknown)
    mode = mode or settings.EXECGO_SANDBOX_MODE
    if mode not in MODES:
        raise _invalid(f"mode must be one of {', '.join(MODES)}", mode=mode)
    profile = requested.get("profile")
    if profile is not None and profile not in PROFILES:
        raise _invalid(f"profile must be one of {', '.join(PROFILES)}", profile=profile)
    network = requested.get("network") or "none"
    if network not in NETWORKS:
        raise _invalid(f"network must be one of {', '.join(NETWORKS)}", network=network)
    return mode, profile, network


class _Downgrades:
    """A plan's downgrades, in the order they were found. In strict mode a
    downgrade refuses the step instead (``denied``), unless it is
    ``allowed``."""

    def __init__(self, mode: str):
        self.mode = mode
        self.entries: list[dict[str, Any]] = []

    def add(self, what: str, wanted: Any, effective: Any, reason: str, *, allowed: bool = False) -> None:
        if self.mode == "strict" and not allowed:
            raise _denied(f"cannot honour {what}={wanted!r}: {reason}", what=what, requested=wanted, reason=reason)
        self.entries.append({"what": what, "requested": wanted, "effective": effective, "reason": reason})


def _profile_on_host(profile: str | None, manifest: Mapping[str, Any], downgrades: _Downgrades
                     ) -> tuple[str, bool]:
    """The profile the step gets here, and whether its seccomp filter applies."""
    bubblewrap = manifest.get("bubblewrap") or {}
    effective_profile = profile or "linux_sandbox"
    if effective_profile == "linux_sandbox" and not bubblewrap.get("available"):
        reason = f"bubblewrap unusable on this host: {bubblewrap.get('error') or 'not available'}"
        # The default is "the strongest there is": falling back is no refusal.
        downgrades.add("profile", "linux_sandbox", "process", reason, allowed=profile is None)
        effective_profile = "process"
    seccomp = effective_profile == "linux_sandbox"
    if seccomp and not (manifest.get("seccomp") or {}).get("available"):
        reason = (manifest.get("seccomp") or {}).get("error") or "not available"
        downgrades.add("seccomp", True, False, f"the system call filter cannot be applied on this host: {reason}")
        seccomp = False
    return effective_profile, seccomp


def _network_on_host(network: str, effective_profile: str, contained: bool, manifest: Mapping[str, Any],
                     downgrades: _Downgrades) -> str:
    """The network the step gets here."""
    if not contained:
        downgrades.add("network", network, "host", "this host cannot give the step a network namespace "
                       "(no bubblewrap, and the worker cannot create namespaces)")
        return "host"
    if network == "internet" and not (manifest.get("pasta") or {}).get("available"):
        downgrades.add("network", "internet", "host", "pasta is not available: no isolated outbound network")
        return "host"
    if network == "internet" and effective_profile != "linux_sandbox":
        downgrades.add("network", "internet", "host", "an isolated outbound network needs bubblewrap")
        return "host"
    return network


def _limits_on_host(limits: dict[str, int | None], *, contained: bool, uid: int | None,
                    manifest: Mapping[str, Any], downgrades: _Downgrades, notes: list[str]) -> None:
    """Drop from ``limits`` what this host cannot enforce for the step."""
    if not contained and limits.get("workspace_bytes") is not None:
        downgrades.add("limits.workspace_bytes", limits["workspace_bytes"], None,
                       "no mount namespace to size the workspace in")
        limits["workspace_bytes"] = None
    rlimits = manifest.get("rlimits") or {}
    asked = {name: value for name, value in limits.items()
             if value is not None and name not in ("log_cap_bytes", "workspace_bytes")}
    if asked and not rlimits.get("enforced"):
        for name, value in sorted(asked.items()):
            downgrades.add(f"limits.{name}", value, None, "rlimits are not enforced on this host")
            limits[name] = None
    if (manifest.get("user") or {}).get("is_root") and uid is None:
        notes.append("runs as root: EXECGO_SANDBOX_UID is none")
        if limits["processes"] is not None:
            downgrades.add("limits.processes", limits["processes"], None, "RLIMIT_NPROC is not enforced for root")
            limits["processes"] = None
