"""The README's Layout tables name every module and package of the apps, and
nothing that does not exist. Reads files only.

The rule: in a table headed `` `<folder>/` `` (or ``path``, for the
repository's root), every backticked name ending in ``.py`` or ``/`` is a
path. In a row's first cell it is relative to the table's folder; in its
description, to the row's folder when the first cell names exactly one
folder, else to the table's folder. Every such path must exist. Every
module (``*.py`` but ``__init__.py``) and every package folder (a folder
with an ``__init__.py``, and each app itself) of the apps must be one of
them, migrations excluded.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ("execgo", "runs", "policy", "approvals", "pages", "runtime", "client", "tools")
EXCLUDED_DIRS = {"migrations", "__pycache__"}
PATH_TOKEN = re.compile(r"^[\w.-]+(?:/[\w.-]+)*(?:\.py|/)$")


def layout_tables(readme: str) -> list[list[list[str]]]:
    """The tables of the Layout section: rows of cells, header first."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    tables, rows = [], []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            if not all(set(cell) <= set("-: ") for cell in cells):  # the |---| line
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def paths_in(cell: str) -> list[str]:
    return [token for token in re.findall(r"`([^`]+)`", cell) if PATH_TOKEN.match(token)]


def named_paths(tables: list[list[list[str]]]) -> tuple[set[Path], list[str]]:
    """Every path the tables name, and each first-cell name in order."""
    named, first_cells = set(), []
    for header, *rows in tables:
        base = ROOT if header[0] == "path" else ROOT / paths_in(header[0])[0]
        named.add(base)
        for first, *rest in rows:
            own = paths_in(first)
            row_base = base / own[0] if len(own) == 1 and own[0].endswith("/") else base
            named |= {base / name for name in own}
            named |= {row_base / name for cell in rest for name in paths_in(cell)}
            first_cells += [str((base / name).relative_to(ROOT)) for name in own]
    return named, first_cells


def project_paths() -> set[Path]:
    found = set()
    for app in APPS:
        found.add(ROOT / app)
        for path in (ROOT / app).rglob("*.py"):
            if EXCLUDED_DIRS & set(path.relative_to(ROOT).parts):
                continue
            if path.name == "__init__.py":
                found.add(path.parent)
            else:
                found.add(path)
    return found


def test_the_layout_tables_name_every_module_and_nothing_else():
    tables = layout_tables((ROOT / "README.md").read_text())
    assert len(tables) >= 2, "no Layout tables found"
    named, first_cells = named_paths(tables)

    missing = sorted(str(path.relative_to(ROOT)) for path in project_paths() - named)
    assert missing == [], f"not in the README's Layout tables: {missing}"
    absent = sorted(str(path.relative_to(ROOT)) for path in named if not path.exists())
    assert absent == [], f"named in the README's Layout tables but not in the repository: {absent}"
    twice = sorted({name for name in first_cells if first_cells.count(name) > 1})
    assert twice == [], f"named by two rows of the Layout tables: {twice}"
