"""Steps for the policy tests, and the seeded rules they are checked against."""

import importlib

seed_migration = importlib.import_module("runs.migrations.0003_seed_policy")
SEEDED = {rule[0]: rule for rule in seed_migration.SEED_RULES}


def shell(command: str | list[str], **extra) -> dict:
    params = {"argv": command} if isinstance(command, list) else {"script": command}
    return {"tool": "shell", "params": params, **extra}


def http(method: str, url: str, **extra) -> dict:
    return {"tool": "http", "params": {"method": method, "url": url}, **extra}


def file(op: str, path: str, **extra) -> dict:
    params = {"op": op, "path": path, **({"content": "x"} if op == "write" else {})}
    return {"tool": "file", "params": params, **extra}
