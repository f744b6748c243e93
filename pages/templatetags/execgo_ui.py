"""Template tags of the pages: badges, pretty JSON, and the server-rendered
SVG pictures (the plan's DAG, the overview's charts)."""

import json

from django import template
from django.utils.html import format_html

from pages.charts import bar_chart_svg, line_chart_svg
from pages.dag import dag_svg
from runs.statemachine import display_group

register = template.Library()


@register.simple_tag
def state_badge(state: str):
    return format_html('<span class="badge badge-{}" data-state="{}">{}</span>', display_group(state), state, state)


@register.simple_tag
def step_badge(status: str):
    return format_html('<span class="badge badge-step-{}">{}</span>', status, status)


@register.simple_tag
def risk_badge(risk: str):
    return format_html('<span class="badge risk-{}">{}</span>', risk, risk)


@register.filter
def pretty_json(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


@register.simple_tag
def plan_dag(steps):
    return dag_svg(steps)


@register.simple_tag
def bar_chart(values, labels, title, unit=""):
    return bar_chart_svg(values, labels=labels, title=title, unit=unit)


@register.simple_tag
def line_chart(series, labels, title, unit=""):
    return line_chart_svg(series, labels=labels, title=title, unit=unit)
