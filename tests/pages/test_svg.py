"""The server-side SVG renderers: the plan DAG and the dashboard charts.

Every SVG is parsed as XML, so a test fails on markup that a browser might
forgive but that is broken (or injectable) all the same."""

import re
import time
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
from django.utils.safestring import SafeString

from pages.charts import bar_chart_svg, line_chart_svg
from pages.dag import NEUTRAL_STROKE, dag_svg

SVG = "{http://www.w3.org/2000/svg}"
HOSTILE = '</text><script>alert("x")</script><text>'


def step(step_id, *depends_on, status="pending", tool="shell", progress=None):
    return {"step_id": step_id, "status": status, "tool": tool, "depends_on": list(depends_on), "progress": progress}


def parse(svg) -> ET.Element:
    assert isinstance(svg, SafeString)
    root = ET.fromstring(str(svg))
    assert root.tag == f"{SVG}svg"
    return root


def with_class(root: ET.Element, name: str) -> list[ET.Element]:
    return [el for el in root.iter() if name in el.get("class", "").split()]


def nodes(root: ET.Element) -> dict[str, ET.Element]:
    return {el.get("data-step"): el for el in with_class(root, "dag-node")}


def node_xy(node: ET.Element) -> tuple[float, float]:
    x, y = re.fullmatch(r"translate\(([\d.]+),([\d.]+)\)", node.get("transform")).groups()
    return float(x), float(y)


def texts(root: ET.Element, name: str) -> list[str]:
    return [el.text or "" for el in with_class(root, name)]


def accessible_name(root: ET.Element) -> str:
    assert root.get("role") == "img"
    (title,) = [el for el in root.iter(f"{SVG}title") if el.get("id") == root.get("aria-labelledby")]
    return title.text


def description(root: ET.Element) -> str:
    (desc,) = [el for el in root.iter(f"{SVG}desc") if el.get("id") == root.get("aria-describedby")]
    return desc.text


DIAMOND = [step("a"), step("b", "a"), step("c", "a"), step("d", "b", "c")]


# --- DAG ---------------------------------------------------------------------


def test_diamond_has_one_node_per_step_and_one_edge_per_dependency():
    root = parse(dag_svg(DIAMOND))
    assert sorted(nodes(root)) == ["a", "b", "c", "d"]
    edges = with_class(root, "dag-edge")
    assert sorted((e.get("data-from"), e.get("data-to")) for e in edges) == [
        ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"),
    ]
    assert all(e.get("marker-end") == "url(#dag-arrow)" for e in edges)
    assert root.find(f"{SVG}defs/{SVG}marker[@id='dag-arrow']") is not None


def test_diamond_columns_follow_depth_and_rows_follow_input_order():
    xy = {step_id: node_xy(node) for step_id, node in nodes(parse(dag_svg(DIAMOND))).items()}
    assert xy["a"][0] < xy["b"][0] == xy["c"][0] < xy["d"][0]
    assert xy["b"][1] < xy["c"][1]


def test_edges_run_from_the_dependency_right_edge_to_the_dependant_left_edge():
    root = parse(dag_svg([step("a"), step("b", "a")]))
    (edge,) = with_class(root, "dag-edge")
    ax, _ = node_xy(nodes(root)["a"])
    bx, _ = node_xy(nodes(root)["b"])
    width = float(nodes(root)["a"].find(f"{SVG}rect").get("width"))
    numbers = [float(n) for n in re.findall(r"[\d.]+", edge.get("d"))]
    assert numbers[0] == ax + width
    assert numbers[-2] == bx


def test_chain_is_one_row_with_x_strictly_increasing():
    chain = [step("s0")] + [step(f"s{i}", f"s{i - 1}") for i in range(1, 6)]
    root = parse(dag_svg(chain))
    xy = [node_xy(nodes(root)[f"s{i}"]) for i in range(6)]
    assert len(with_class(root, "dag-edge")) == 5
    assert all(left[0] < right[0] for left, right in zip(xy, xy[1:]))
    assert len({y for _, y in xy}) == 1


def test_depth_is_the_longest_path_and_input_order_need_not_be_topological():
    # c depends on a directly and through b, so it belongs after b, not beside it.
    root = parse(dag_svg([step("c", "a", "b"), step("b", "a"), step("a")]))
    xy = {step_id: node_xy(node) for step_id, node in nodes(root).items()}
    assert xy["a"][0] < xy["b"][0] < xy["c"][0]


def test_nodes_carry_status_class_data_step_and_index_id():
    statuses = ["pending", "running", "success", "failed", "skipped"]
    steps = [step(f"s{i}", status=status) for i, status in enumerate(statuses)]
    root = parse(dag_svg(steps))
    for i, status in enumerate(statuses):
        (node,) = [el for el in root.iter(f"{SVG}g") if el.get("id") == f"dag-node-{i}"]
        assert node.get("class") == f"dag-node step-{status}"
        assert node.get("data-step") == f"s{i}"
        # Said in words as well, not by colour alone.
        assert status in texts(node, "dag-tool")[0]


def test_an_unknown_status_does_not_become_a_class_name():
    root = parse(dag_svg([step("a", status="pwned onclick")]))
    assert nodes(root)["a"].get("class") == "dag-node step-unknown"


def test_model_like_objects_are_accepted_as_well_as_dicts():
    steps = [SimpleNamespace(**s) for s in DIAMOND]
    assert str(dag_svg(steps)) == str(dag_svg(DIAMOND))


def test_tool_is_shown_in_smaller_text():
    root = parse(dag_svg([step("a", tool="http")]))
    (tool,) = with_class(root, "dag-tool")
    assert tool.text.startswith("http")
    assert float(tool.get("font-size")) < float(root.get("font-size"))


def test_long_ids_are_truncated_with_the_full_id_in_the_tooltip():
    long_id = "fetch-the-quarterly-report-and-summarise"
    root = parse(dag_svg([step(long_id), step("short", long_id)]))
    node = nodes(root)[long_id]
    (label,) = texts(node, "dag-label")
    assert label.endswith("\u2026") and len(label) <= 18
    assert long_id.startswith(label[:-1])
    assert node.find(f"{SVG}title").text.startswith(long_id)
    assert texts(nodes(root)["short"], "dag-label") == ["short"]


def test_a_running_step_with_progress_shows_a_proportional_bar():
    root = parse(dag_svg([step("a", status="running", progress=25), step("b", status="running", progress=100)]))
    bars = {sid: with_class(node, "dag-progress-bar") for sid, node in nodes(root).items()}
    (quarter,), (full,) = bars["a"], bars["b"]
    assert float(quarter.get("width")) * 4 == pytest.approx(float(full.get("width")))
    assert "25%" in nodes(root)["a"].find(f"{SVG}title").text


@pytest.mark.parametrize(
    "kwargs", [{"status": "running", "progress": None}, {"status": "success", "progress": 50}, {"status": "pending"}]
)
def test_no_progress_bar_unless_running_with_a_value(kwargs):
    root = parse(dag_svg([step("a", **kwargs)]))
    assert with_class(root, "dag-progress-bar") == []
    assert with_class(root, "dag-progress-track") == []


def test_a_hostile_step_id_is_escaped():
    svg = str(dag_svg([step(HOSTILE), step("b", HOSTILE, tool="<img src=x onerror=alert(1)>")]))
    root = parse(svg)
    assert "<script" not in svg and "<img" not in svg
    assert "&lt;script&gt;" in svg
    assert [el for el in root.iter() if el.tag.split("}")[-1] in {"script", "img"}] == []
    # Escaping must round-trip: the parsed values are the agent's exact text.
    assert HOSTILE in nodes(root)
    assert nodes(root)[HOSTILE].find(f"{SVG}title").text.startswith(HOSTILE)
    assert [e.get("data-from") for e in with_class(root, "dag-edge")] == [HOSTILE]


def test_characters_xml_cannot_carry_do_not_break_the_document():
    parse(dag_svg([step("bell\x07and\x1bescape"), step("b", "bell\x07and\x1bescape")]))


def test_accessible_title_desc_and_scalable_viewbox():
    root = parse(dag_svg(DIAMOND))
    assert accessible_name(root) == "Plan: 4 steps, 4 dependencies"
    assert description(root) == "4 pending"
    assert root.get("width") == "100%"
    assert "max-height" in root.get("style")
    _, _, width, height = (float(n) for n in root.get("viewBox").split())
    right, bottom = max(node_xy(n)[0] for n in nodes(root).values()), max(node_xy(n)[1] for n in nodes(root).values())
    assert right < width and bottom < height


def test_colours_come_from_classes_apart_from_the_neutral_default():
    root = parse(dag_svg([step("a", status="running", progress=40), step("b", "a", status="failed")]))
    painted = {el.get(attr) for el in root.iter() for attr in ("fill", "stroke", "color") if el.get(attr)}
    assert painted == {"none", NEUTRAL_STROKE}
    assert "color" not in root.get("style") and "#" not in root.get("style")


def test_an_empty_plan_renders_and_says_so():
    root = parse(dag_svg([]))
    assert accessible_name(root) == "Plan: 0 steps, 0 dependencies"
    assert texts(root, "dag-empty") == ["No steps"]


@pytest.mark.parametrize(
    "steps, message",
    [
        ([step("a", "b"), step("b", "a")], "cycle"),
        ([step("a", "ghost")], "unknown step"),
        ([step("a"), step("a")], "duplicate"),
    ],
)
def test_a_plan_that_is_not_a_dag_is_refused(steps, message):
    with pytest.raises(ValueError, match=message):
        dag_svg(steps)


def test_a_200_step_plan_renders_quickly():
    # Each step waits on the previous one and on one seven back: long paths and
    # crossing edges, the expensive shape for the layout.
    steps = [step(f"step-{i}", *(f"step-{j}" for j in (i - 1, i - 7) if j >= 0)) for i in range(200)]
    best = float("inf")
    for _ in range(3):  # the best of three, so a busy machine does not fail it
        started = time.perf_counter()
        svg = dag_svg(steps)
        best = min(best, time.perf_counter() - started)
    root = parse(svg)
    assert len(with_class(root, "dag-node")) == 200
    assert len(with_class(root, "dag-edge")) == 199 + 193
    # A generous bound (about 15 ms on a quiet machine): it catches a layout
    # gone quadratic or worse, not a busy machine.
    assert best < 0.5


# --- Bar chart -----------------------------------------------------------------

MINUTES = [f"10:{m:02d}" for m in range(60)]


def runs_per_minute():
    values = [m % 5 for m in range(60)]
    values[42] = 12
    return values


def bar_heights(root):
    return [float(bar.get("height")) for bar in with_class(root, "chart-bar")]


def test_bar_chart_has_one_bar_per_value_scaled_to_the_value():
    values = runs_per_minute()
    root = parse(bar_chart_svg(values, labels=MINUTES, title="Runs per minute", unit="runs/min"))
    heights = bar_heights(root)
    assert len(heights) == 60
    assert heights.index(max(heights)) == 42
    assert heights[2] == pytest.approx(2 * heights[1], abs=0.2)  # coordinates are rounded to 0.1
    assert heights[0] == 0


def test_bar_chart_is_described_in_words():
    root = parse(bar_chart_svg(runs_per_minute(), labels=MINUTES, title="Runs per minute", unit="runs/min"))
    assert accessible_name(root) == "Runs per minute"
    assert "max 12 runs/min at 10:42" in description(root)
    assert root.get("width") == "100%" and root.get("viewBox")


def test_bar_chart_axis_labels():
    root = parse(bar_chart_svg(runs_per_minute(), labels=MINUTES, title="Runs", unit="runs/min"))
    (axis,) = with_class(root, "chart-axis")
    assert texts(axis, "chart-y-zero") == ["0"]
    (y_max,) = texts(axis, "chart-y-max")
    assert float(y_max) >= 12
    assert texts(root, "chart-x-label") == ["10:00", "10:29", "10:59"]
    assert texts(root, "chart-unit") == ["runs/min"]


def test_bar_chart_none_is_a_missing_bar_not_a_zero():
    root = parse(bar_chart_svg([3, None, 0], labels=["a", "b", "c"], title="t"))
    assert len(bar_heights(root)) == 2
    assert "1 without data" in description(root)


@pytest.mark.parametrize("values", [[], [None, None]])
def test_bar_chart_without_data_says_no_data(values):
    root = parse(bar_chart_svg(values, labels=[str(i) for i in range(len(values))], title="Runs"))
    assert description(root) == "no data"
    assert texts(root, "chart-empty") == ["No data"]
    assert with_class(root, "chart-bar") == []
    assert texts(root, "chart-y-max") == [] and texts(root, "chart-y-zero") == ["0"]


def test_bar_chart_all_zero_draws_flat_bars_and_says_so():
    root = parse(bar_chart_svg([0] * 60, labels=MINUTES, title="Runs", unit="runs/min"))
    assert bar_heights(root) == [0] * 60
    assert "all values are 0 runs/min" in description(root)
    assert texts(root, "chart-empty") == ["All values 0 runs/min"]
    assert texts(root, "chart-y-max") == ["1"]


def test_bar_chart_escapes_title_labels_and_unit():
    svg = str(bar_chart_svg([1, 2], labels=[HOSTILE, "b"], title=HOSTILE, unit="<b>"))
    root = parse(svg)
    assert "<script" not in svg and "<b>" not in svg
    assert accessible_name(root) == HOSTILE
    assert texts(root, "chart-x-label")[0] == HOSTILE


def test_bar_chart_refuses_mismatched_labels():
    with pytest.raises(ValueError, match="2 labels for 3 values"):
        bar_chart_svg([1, 2, 3], labels=["a", "b"], title="t")


# --- Line chart ----------------------------------------------------------------

BUCKETS = [f"10:{m:02d}" for m in range(0, 60, 5)]


def subpaths(line: ET.Element) -> list[list[tuple[float, float]]]:
    return [
        [tuple(float(n) for n in point.split(",")) for point in re.findall(r"[\d.]+,[\d.]+", segment)]
        for segment in line.get("d").split("M")[1:]
    ]


def test_line_chart_draws_one_classed_line_per_series():
    series = {"p50": [1.0] * 12, "p95": [2.0] * 12}
    root = parse(line_chart_svg(series, labels=BUCKETS, title="Duration", unit="s"))
    lines = with_class(root, "chart-line")
    assert [line.get("class") for line in lines] == ["chart-line chart-line-0", "chart-line chart-line-1"]
    # Higher values are drawn higher up (smaller y).
    (p50,), (p95,) = subpaths(lines[0]), subpaths(lines[1])
    assert len(p50) == 12 and p95[0][1] < p50[0][1]
    assert texts(root, "chart-legend-label") == ["p50", "p95"]


def test_line_chart_none_is_a_gap_and_a_lone_point_is_a_dot():
    values = [1, 2, None, None, 3, 4, 5, None, 6, None, 7, 8]
    root = parse(line_chart_svg({"p95": values}, labels=BUCKETS, title="Duration", unit="s"))
    (line,) = with_class(root, "chart-line")
    assert [len(segment) for segment in subpaths(line)] == [2, 3, 2]
    assert len(with_class(root, "chart-point")) == 1
    assert "4 of 12 without data" in description(root)


def test_line_chart_is_described_in_words():
    series = {"p50": [0.5] * 11 + [0.8], "p95": [1.0] * 6 + [4.5] + [2.0] * 5}
    root = parse(line_chart_svg(series, labels=BUCKETS, title="Step duration", unit="s"))
    assert accessible_name(root) == "Step duration"
    desc = description(root)
    assert "p50: max 0.8 s at 10:55" in desc
    assert "p95: max 4.5 s at 10:30" in desc
    assert texts(root, "chart-x-label") == ["10:00", "10:25", "10:55"]
    assert texts(root, "chart-y-zero") == ["0"] and float(texts(root, "chart-y-max")[0]) >= 4.5


def test_line_chart_not_a_number_is_a_gap_not_a_broken_coordinate():
    root = parse(line_chart_svg({"p50": [1, float("nan"), 2, float("inf")]}, labels=list("abcd"), title="t"))
    assert "nan" not in ET.tostring(root, encoding="unicode").lower()
    assert len(with_class(root, "chart-point")) == 2


@pytest.mark.parametrize("series", [{}, {"p50": [None] * 12, "p95": [None] * 12}])
def test_line_chart_without_data_says_no_data(series):
    labels = BUCKETS if series else []
    root = parse(line_chart_svg(series, labels=labels, title="Duration"))
    assert description(root) == "no data"
    assert texts(root, "chart-empty") == ["No data"]
    assert with_class(root, "chart-line") == [] and with_class(root, "chart-point") == []


def test_line_chart_all_zero_is_a_flat_line_on_the_axis():
    root = parse(line_chart_svg({"p50": [0] * 12}, labels=BUCKETS, title="Duration", unit="s"))
    (points,) = subpaths(with_class(root, "chart-line")[0])
    (zero_label,) = with_class(root, "chart-y-zero")
    assert {y for _, y in points} == {float(zero_label.get("y"))}
    assert "all 0 s" in description(root)
    assert texts(root, "chart-empty") == ["All values 0 s"]


def test_line_chart_escapes_series_names_and_labels():
    svg = str(line_chart_svg({HOSTILE: [1, 2]}, labels=["<i>", "b"], title="t"))
    root = parse(svg)
    assert "<script" not in svg and "<i>" not in svg
    assert texts(root, "chart-legend-label") == [HOSTILE]


def test_line_chart_refuses_a_series_of_the_wrong_length():
    with pytest.raises(ValueError, match="series 'p95'"):
        line_chart_svg({"p50": [1, 2], "p95": [1]}, labels=["a", "b"], title="t")


def test_charts_use_only_neutral_inline_colours():
    roots = [
        parse(bar_chart_svg(runs_per_minute(), labels=MINUTES, title="t")),
        parse(line_chart_svg({"a": [1, None, 2], "b": [None, 3, None]}, labels=list("xyz"), title="t")),
    ]
    painted = {el.get(attr) for root in roots for el in root.iter() for attr in ("fill", "stroke") if el.get(attr)}
    assert painted == {"none", "#767676"}
    assert all(el.get("style") is None for root in roots for el in root.iter())
