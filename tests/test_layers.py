"""The import-linter contracts (pyproject.toml) hold, and can fail: a scratch
copy of the tree with one upward import added breaks them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("execgo", "runs", "policy", "pages", "runtime", "approvals")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)})


@pytest.fixture
def scratch_tree(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(tree: Path, module: str, line: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_tree_keeps_its_contracts():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, line, contract", [
    # closing is below execution: closing → execution would close a circle
    ("runs.closing", "from runs import execution  # noqa", "runs reads top-down"),
    # the kernel sends its tasks by name and never imports them
    ("runs.execution", "from runs import tasks  # noqa", "runs reads top-down"),
    ("runtime.capabilities", "from runtime import executor  # noqa", "runtime reads top-down"),
    # the relay is the kernel's: the pages and the API use it, it uses neither
    ("runs.relay", "from pages import consumers  # noqa", "no app imports the pages"),
    ("pages.dag", "from pages import views  # noqa", "pages reads top-down"),
    # the rules' changes are below the rating that reads them
    ("policy.rules", "from policy import evaluation  # noqa", "policy reads top-down"),
    # the kernel calls the policy at POLICY_CHECK, never the other way round
    ("policy.evaluation", "from runs import pipeline  # noqa", "the policy imports only the kernel's lower modules"),
    ("policy.shell_words", "from approvals import models  # noqa", "the policy imports only the kernel's lower"),
    ("runs.pipeline", "from policy import rules  # noqa", "other apps ask the policy only through policy.interface"),
    ("approvals.edits", "from policy.evaluation import evaluate_policy  # noqa",
     "other apps ask the policy only through policy.interface"),
    ("runtime.ledger", "from runs import models  # noqa", "Tier 3 (runtime) knows nothing of RunState"),
    ("runtime.ledger", "from execgo import settings  # noqa", "Tier 3 (runtime) knows nothing of RunState"),
])
def test_an_upward_import_breaks_a_contract(scratch_tree, module, line, contract):
    assert lint_imports(scratch_tree).returncode == 0  # the copy is sound before the change
    add_import(scratch_tree, module, line)

    result = lint_imports(scratch_tree)

    assert result.returncode != 0
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(contract)]
    assert verdicts and verdicts[0].endswith("BROKEN"), result.stdout
