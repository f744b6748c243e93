"""The run page's plan diagram: one box per step, in columns by dependency
depth, with an arrow from each dependency to the step that waits for it.

Drawn here as SVG markup rather than in the browser because the dashboard is
server-rendered and must work offline and without JavaScript: there is no
graph library to ship, the diagram is in the first response, and it is the
same on every device. Step ids and tools come from agents, so every piece of
text is escaped (and stripped of characters XML cannot carry) on the way in.
"""

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

STATUSES = ("pending", "running", "success", "failed", "skipped")

NODE_WIDTH = 168
NODE_HEIGHT = 46
COLUMN_GAP = 56
ROW_GAP = 14
PADDING = 12
LABEL_MAX_CHARS = 18
# The one inline colour: a mid grey with 4.5:1 contrast on both white and
# black, so boxes and arrows stay visible when the page stylesheet is missing.
NEUTRAL_STROKE = "#767676"

# XML 1.0 cannot carry these even as character references, and a step id is
# any string an agent chose: one stray control character would make the whole
# SVG ill-formed.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


@dataclass(frozen=True)
class _Node:
    index: int
    step_id: str
    status: str
    tool: str
    depends_on: tuple[str, ...]
    progress: float | None


@dataclass(frozen=True)
class _Layout:
    position: dict[str, tuple[int, int]]  # step id -> top-left corner of its box
    width: int
    height: int


def _text(value: object) -> str:
    return escape(_XML_INVALID.sub("\ufffd", str(value)))


def _field(step: object, name: str, default: object = None) -> object:
    # Templates hand over model instances; tests and previews hand over dicts.
    if isinstance(step, Mapping):
        return step.get(name, default)
    return getattr(step, name, default)


def _node(index: int, step: object) -> _Node:
    status = str(_field(step, "status", "pending"))
    progress = _field(step, "progress")
    return _Node(
        index=index,
        step_id=str(_field(step, "step_id")),
        # An unexpected status must not mint an arbitrary class name.
        status=status if status in STATUSES else "unknown",
        tool=str(_field(step, "tool", "")),
        # A repeated dependency is still one arrow.
        depends_on=tuple(dict.fromkeys(str(dep) for dep in _field(step, "depends_on", None) or ())),
        progress=None if progress is None else max(0.0, min(100.0, float(progress))),
    )


def _depths(nodes: Sequence[_Node]) -> dict[str, int]:
    """Longest path from a root, by Kahn's algorithm: a step's depth is final
    once all its dependencies have been placed. Input order need not be
    topological."""
    by_id = {node.step_id: node for node in nodes}
    if len(by_id) != len(nodes):
        raise ValueError("duplicate step ids in plan")
    waiting = {node.step_id: len(node.depends_on) for node in nodes}
    dependants: dict[str, list[str]] = {node.step_id: [] for node in nodes}
    for node in nodes:
        for dep in node.depends_on:
            if dep not in by_id:
                raise ValueError(f"step {node.step_id!r} depends on unknown step {dep!r}")
            dependants[dep].append(node.step_id)
    depth = dict.fromkeys(by_id, 0)
    ready = [step_id for step_id, count in waiting.items() if count == 0]
    while ready:
        step_id = ready.pop()
        for child in dependants[step_id]:
            depth[child] = max(depth[child], depth[step_id] + 1)
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    if any(waiting.values()):
        raise ValueError("plan has a dependency cycle")
    return depth


def _layout(nodes: Sequence[_Node]) -> _Layout:
    depth = _depths(nodes)
    columns: dict[int, list[str]] = {}
    for node in nodes:  # input order, so a column lists steps as the plan did
        columns.setdefault(depth[node.step_id], []).append(node.step_id)
    position = {
        step_id: (PADDING + column * (NODE_WIDTH + COLUMN_GAP), PADDING + row * (NODE_HEIGHT + ROW_GAP))
        for column, step_ids in columns.items()
        for row, step_id in enumerate(step_ids)
    }
    column_count = max(columns, default=0) + 1
    row_count = max((len(step_ids) for step_ids in columns.values()), default=1)
    return _Layout(
        position=position,
        width=2 * PADDING + column_count * NODE_WIDTH + (column_count - 1) * COLUMN_GAP,
        height=2 * PADDING + row_count * NODE_HEIGHT + (row_count - 1) * ROW_GAP,
    )


def _plural(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def _summary(nodes: Sequence[_Node]) -> tuple[str, str]:
    edge_count = sum(len(node.depends_on) for node in nodes)
    title = f"Plan: {_plural(len(nodes), 'step', 'steps')}, {_plural(edge_count, 'dependency', 'dependencies')}"
    # The image is one opaque element to a screen reader, so the statuses the
    # colours show must also be said in words.
    counts = {status: 0 for status in (*STATUSES, "unknown")}
    for node in nodes:
        counts[node.status] += 1
    desc = ", ".join(f"{count} {status}" for status, count in counts.items() if count) or "no steps"
    return title, desc


def _edge(dep: str, node: _Node, layout: _Layout) -> str:
    x1, y1 = layout.position[dep]
    x2, y2 = layout.position[node.step_id]
    x1 += NODE_WIDTH
    y1 += NODE_HEIGHT // 2
    y2 += NODE_HEIGHT // 2
    bend = COLUMN_GAP // 2
    return (
        f'<path class="dag-edge" data-from="{_text(dep)}" data-to="{_text(node.step_id)}" '
        f'd="M{x1},{y1} C{x1 + bend},{y1} {x2 - bend},{y2} {x2},{y2}" '
        f'fill="none" stroke="{NEUTRAL_STROKE}" marker-end="url(#dag-arrow)"/>'
    )


def _label(step_id: str) -> str:
    if len(step_id) <= LABEL_MAX_CHARS:
        return step_id
    return step_id[: LABEL_MAX_CHARS - 1] + "\u2026"


def _progress_bar(progress: float) -> str:
    inner = NODE_WIDTH - 20
    filled = round(inner * progress / 100, 1)
    return (
        f'<rect class="dag-progress-track" x="10" y="{NODE_HEIGHT - 6}" width="{inner}" height="3" '
        f'fill="none" stroke="{NEUTRAL_STROKE}" stroke-width="0.5"/>'
        f'<rect class="dag-progress-bar" x="10" y="{NODE_HEIGHT - 6}" width="{filled}" height="3"/>'
    )


def _box(node: _Node, layout: _Layout) -> str:
    x, y = layout.position[node.step_id]
    showing_progress = node.status == "running" and node.progress is not None
    state = f"running {node.progress:.0f}%" if showing_progress else node.status
    return (
        f'<g class="dag-node step-{node.status}" data-step="{_text(node.step_id)}" id="dag-node-{node.index}" '
        f'transform="translate({x},{y})">'
        f"<title>{_text(node.step_id)} ({_text(node.tool)}, {state})</title>"
        f'<rect class="dag-box" width="{NODE_WIDTH}" height="{NODE_HEIGHT}" rx="6" '
        f'fill="none" stroke="{NEUTRAL_STROKE}"/>'
        f'<text class="dag-label" x="10" y="19">{_text(_label(node.step_id))}</text>'
        # The status is written out too: colour alone would not tell it apart.
        f'<text class="dag-tool" x="10" y="34" font-size="11">{_text(node.tool)} \u00b7 {state}</text>'
        f"{_progress_bar(node.progress) if showing_progress else ''}"
        "</g>"
    )


def _arrow_marker() -> str:
    # An open chevron drawn with a stroke, so it needs no fill colour of its own.
    return (
        '<defs><marker id="dag-arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="8" markerHeight="8" '
        'markerUnits="userSpaceOnUse" orient="auto">'
        f'<path class="dag-arrow" d="M0,0 L8,4 L0,8" fill="none" stroke="{NEUTRAL_STROKE}"/></marker></defs>'
    )


def dag_svg(steps: Sequence[object]) -> SafeString:
    """An accessible SVG of the plan's DAG; ``steps`` are Step instances or
    dicts with step_id, status, tool, depends_on and optionally progress.
    Raises ValueError for a plan that is not a DAG (duplicate ids, unknown
    dependencies, cycles), which validation should have stopped earlier."""
    nodes = [_node(index, step) for index, step in enumerate(steps)]
    layout = _layout(nodes)
    title, desc = _summary(nodes)
    # Derived from the content so ids are stable and two diagrams on one page
    # only share an id when they would also share its text.
    key = hashlib.blake2s(f"{title}|{desc}".encode(errors="surrogatepass"), digest_size=4).hexdigest()
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="dag" role="img" '
        f'aria-labelledby="dag-{key}-title" aria-describedby="dag-{key}-desc" '
        f'viewBox="0 0 {layout.width} {layout.height}" width="100%" preserveAspectRatio="xMinYMin meet" '
        # Never drawn larger than life on a wide screen, nor taller than the
        # window for a long plan; narrower screens scale it down.
        f'style="max-width:{layout.width}px;max-height:80vh" '
        'font-family="system-ui, sans-serif" font-size="13">',
        f'<title id="dag-{key}-title">{_text(title)}</title>',
        f'<desc id="dag-{key}-desc">{_text(desc)}</desc>',
        _arrow_marker(),
    ]
    if not nodes:
        parts.append(f'<text class="dag-empty" x="{PADDING}" y="{PADDING + 19}">No steps</text>')
    # Edges first, so the boxes are painted over the ends of the curves.
    parts.extend(_edge(dep, node, layout) for node in nodes for dep in node.depends_on)
    parts.extend(_box(node, layout) for node in nodes)
    parts.append("</svg>")
    return mark_safe("".join(parts))
