"""Helpers of the server-rendered pages' tests (tests/pages/test_pages_*.py):
the tags of a page, the rows of the runs list and the state counts of the
overview, signed-in clients, and runs and steps made directly."""

import re
from html.parser import HTMLParser

from django.test import Client
from django.utils import timezone

from runs.models import Job, Run, Step


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {name: value or "" for name, value in attrs}))

    handle_startendtag = handle_starttag


def tags(html: str, name: str) -> list[dict[str, str]]:
    """The attributes of every ``<name>`` start tag of the page."""
    parser = _Tags()
    parser.feed(html)
    return [attrs for tag, attrs in parser.tags if tag == name]


def html_of(response) -> str:
    return response.content.decode()


def row_ids(html: str) -> list[int]:
    return [int(pk) for pk in re.findall(r'<tr id="run-(\d+)"', html)]


def signed_in(user, **kwargs) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def run_in(tenant, user, state: str = "CREATED", **fields) -> Run:
    """A run of another tenant than the ``make_run`` factory's."""
    job = Job.objects.create(tenant=tenant, created_by=user)
    run = Run.objects.create(job=job, tenant=tenant, submitted_by=user, state=state, plan={"steps": []},
                             timeout_s=600, approval_timeout_s=3600, last_state_change_at=timezone.now(), **fields)
    Job.objects.filter(pk=job.pk).update(latest_run=run)
    return run


def add_step(run: Run, step_id: str, position: int, *depends_on: str, **fields) -> Step:
    return Step.objects.create(run=run, step_id=step_id, position=position, tool="shell",
                               params={"argv": ["true"]}, depends_on=list(depends_on), timeout_s=5, **fields)


def state_counts(html: str) -> dict[str, int]:
    return {state: int(n) for state, n in re.findall(r'data-state="(\w+)"><div class="n">(\d+)</div>', html)}
