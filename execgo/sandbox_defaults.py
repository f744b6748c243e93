"""What every step's sandbox gets unless the step asks otherwise: what it
is kept from seeing of the host (the default of EXECGO_SANDBOX_HIDDEN_PATHS),
what it is shown (EXECGO_SANDBOX_READONLY_PATHS, checked: a path that would
expose the data or tasks directory stops the start instead of being mounted
into every step), and its resource limits with the most it may ask for.
"""

from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from execgo.env import env_int
from runtime.sandbox import validate_readonly_paths


def etc_secret_paths() -> list[str]:
    """The default hidden paths: /etc's secrets (password hashes, SSH host
    keys, TLS private keys, sudoers, the config of database and broker
    servers)."""
    return [
        "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/security/opasswd", "/etc/sudoers",
        "/etc/sudoers.d", "/etc/ssh", "/etc/ssl/private", "/etc/postgresql", "/etc/redis", "/etc/mysql",
        "/etc/rabbitmq", "/etc/mosquitto", "/etc/nats-server.conf", "/etc/krb5.keytab", "/etc/letsencrypt",
        "/etc/docker", "/etc/wireguard", "/etc/ipsec.secrets", "/etc/ppp", "/etc/NetworkManager/system-connections",
    ]


def readonly_paths(paths: list[str], *, data_dir: Path, tasks_dir: Path) -> list[str]:
    """The operator's read-only paths, checked by the rules the plan
    resolver applies to a step's own (``runtime/sandbox.py``)."""
    try:
        return validate_readonly_paths(paths, data_dir=str(data_dir), tasks_dir=str(tasks_dir))
    except ValueError as exc:
        raise ImproperlyConfigured(f"EXECGO_SANDBOX_READONLY_PATHS: {exc}") from None


def default_limits() -> dict[str, int | None]:
    """Limits of every step: a step's sandbox.limits override them, up to
    ``limit_caps``; None: no limit. workspace_bytes sizes the step's
    workspace and its /tmp (each a tmpfs of that size)."""
    return {
        "cpu_seconds": env_int("EXECGO_LIMIT_CPU_SECONDS", 600),
        "address_space_bytes": env_int("EXECGO_LIMIT_ADDRESS_SPACE_BYTES", 8 * 1024**3),
        "file_size_bytes": env_int("EXECGO_LIMIT_FILE_SIZE_BYTES", 1024**3),
        "open_files": env_int("EXECGO_LIMIT_OPEN_FILES", 1024),
        "processes": env_int("EXECGO_LIMIT_PROCESSES", 256),
        "workspace_bytes": env_int("EXECGO_LIMIT_WORKSPACE_BYTES", 1024**3),
        "log_cap_bytes": env_int("EXECGO_LIMIT_LOG_CAP_BYTES", 8 * 1024 * 1024),
    }


def limit_caps() -> dict[str, int | None]:
    """The most a step may ask for (None: no cap; a step may then also ask for no limit)."""
    return {
        "cpu_seconds": env_int("EXECGO_LIMIT_CAP_CPU_SECONDS", 24 * 3600),
        "address_space_bytes": env_int("EXECGO_LIMIT_CAP_ADDRESS_SPACE_BYTES", 64 * 1024**3),
        "file_size_bytes": env_int("EXECGO_LIMIT_CAP_FILE_SIZE_BYTES", 16 * 1024**3),
        "open_files": env_int("EXECGO_LIMIT_CAP_OPEN_FILES", 65536),
        "processes": env_int("EXECGO_LIMIT_CAP_PROCESSES", 4096),
        "workspace_bytes": env_int("EXECGO_LIMIT_CAP_WORKSPACE_BYTES", 16 * 1024**3),
        "log_cap_bytes": env_int("EXECGO_LIMIT_CAP_LOG_CAP_BYTES", 1024**3),
    }
