"""Every environment variable execgo/settings.py (with the execgo modules it
imports), the Procfile and execgo_bootstrap read is documented in README.md's
one Configuration table, and nothing else is."""

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READERS = {"env_str", "env_int", "env_float", "env_bool", "env_list"}


def settings_modules() -> list[Path]:
    """execgo/settings.py and the execgo modules it imports, which build
    some settings and read the environment for them (the step limits)."""
    settings = ROOT / "execgo" / "settings.py"
    imported = [node.module for node in ast.walk(ast.parse(settings.read_text()))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("execgo.")]
    return [settings, *(ROOT / (module.replace(".", "/") + ".py") for module in imported)]


def settings_names() -> set[str]:
    names = set()
    for node in (node for path in settings_modules() for node in ast.walk(ast.parse(path.read_text()))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in READERS:
            first = node.args[0] if node.args else None
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
                f"line {node.lineno}: {node.func.id} without a literal variable name"
            )
            names.add(first.value)
    return names


def other_names() -> set[str]:
    """The Procfile's variables and execgo_bootstrap's passwords."""
    from runs.management.commands.execgo_bootstrap import ACCOUNTS

    procfile = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (ROOT / "Procfile").read_text()))
    return procfile | {account.env_var for account in ACCOUNTS if account.signs_in}


def readme_names() -> set[str]:
    """The backquoted names in the first column of the Configuration table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("|"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_*]*)`", line.split("|")[1]))
    return names


def test_every_setting_is_documented():
    documented = readme_names()
    read = settings_names() | other_names()
    assert len(read) > 50 and {"EXECGO_PORT", "EXECGO_ADMIN_PASSWORD"} <= read
    missing = sorted(name for name in read if not any(fnmatch.fnmatchcase(name, doc) for doc in documented))
    assert not missing, f"not in README.md's Configuration table: {missing}"


def test_every_documented_name_is_read():
    read = settings_names() | other_names()
    stale = sorted(doc for doc in readme_names() if not any(fnmatch.fnmatchcase(name, doc) for name in read))
    assert not stale, f"README.md documents variables the settings do not read: {stale}"
