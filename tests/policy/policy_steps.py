"""Steps for the policy tests, and the seeded rules they are checked against."""

import importlib

seed_migration = importlib.import_module("runs.migrations.0003_seed_policy")
word_rules_migration = importlib.import_module("runs.migrations.0011_policy_argv_rules")
# The default policy after every migration: 0003's rules, as 0011 rewrote or added them.
SEEDED = {rule[0]: rule for rule in seed_migration.SEED_RULES} | {rule[0]: rule
                                                                   for rule in word_rules_migration.WORD_RULES}
# A shell step's risk starts from its plan: these tests rate what the rules
# add to the contained baseline (sandboxed, no network, limited processes).
SANDBOXED = {"profile": "linux_sandbox", "limits": {"processes": 64}}


def shell(command: str | list[str], **extra) -> dict:
    params = {"argv": command} if isinstance(command, list) else {"script": command}
    sandbox = extra.pop("sandbox", {})
    sandbox = {**SANDBOXED, **sandbox, "limits": {**SANDBOXED["limits"], **sandbox.get("limits", {})}}
    return {"tool": "shell", "params": params, "sandbox": sandbox, **extra}


def http(method: str, url: str, **extra) -> dict:
    return {"tool": "http", "params": {"method": method, "url": url}, **extra}


def file(op: str, path: str, **extra) -> dict:
    params = {"op": op, "path": path, **({"content": "x"} if op == "write" else {})}
    return {"tool": "file", "params": params, **extra}
