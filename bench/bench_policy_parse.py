"""What the parsed-command policy adds to POLICY_CHECK per shell step: parsing
(policy.shell_words) and matching the seeded ``words`` rules, in ms — the
median and p95 over the test corpus's commands, and the slowest of a few
crafted scripts of EXECGO_BUDGET_MAX_COMMAND_CHARS (8192) characters, the
longest text the policy rates.

    .venv/bin/python bench/bench_policy_parse.py [--rounds 20]

Needs no database: the rules come from the migration that seeds them.
Nothing is executed.
"""

import argparse
import importlib
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "execgo.settings")

import django  # noqa: E402

django.setup()

from policy.shell_words import parse_argv, parse_script  # noqa: E402
from tests.policy.test_policy_corpus import BENIGN, CORPUS  # noqa: E402

MAX_CHARS = 8192
CRAFTED = {
    "1000 commands": "echo a; " * 1000,
    "one long argument list": "rm " + "-r " * 2700,
    "2000-stage pipeline": "a | " * 2000 + "b",
    "deep subshells": "(" * 4000 + "echo" + ")" * 4000,
    "deep substitutions": "echo " + "$(" * 2700 + "x" + ")" * 2700,
    "unterminated quote": "'" + "a" * 8190,
}


def rate(command, rules) -> None:
    parsed = parse_argv(command) if isinstance(command, list) else parse_script(command)
    for text in parsed.texts():
        for pattern in rules:
            pattern.search(text)


def timed(command, rules) -> float:
    started = time.perf_counter()
    rate(command, rules)
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    migration = importlib.import_module("runs.migrations.0011_policy_argv_rules")
    rules = [re.compile(rule[3]) for rule in migration.WORD_RULES]
    commands = [command for command, _ in CORPUS] + BENIGN

    samples = sorted(timed(command, rules) for _ in range(args.rounds) for command in commands)
    p95 = samples[int(len(samples) * 0.95)]
    print(f"corpus: {len(commands)} commands x {args.rounds} rounds, {len(rules)} word rules: "
          f"median {statistics.median(samples):.2f} ms, p95 {p95:.2f} ms, max {samples[-1]:.2f} ms per step")
    for name, script in CRAFTED.items():
        script = script[:MAX_CHARS]
        best = min(timed(script, rules) for _ in range(3))
        print(f"crafted {name} ({len(script)} chars): {best:.1f} ms")


if __name__ == "__main__":
    main()
