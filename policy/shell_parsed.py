"""What the shell parser produces (``ParsedShell``: simple commands,
pipelines, signals, files written) and what it carries while it walks a
command line (``Context``). ``policy.shell_words`` parses scripts,
``policy.shell_commands`` reads what each simple command runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

UNRESOLVABLE = "unresolvable"
INLINE_CODE = "inline_code"
MAX_DEPTH = 8  # nested sh -c / eval / wrappers; deeper is itself a signal


@dataclass(frozen=True)
class SimpleCommand:
    words: tuple[str, ...]
    redirects: tuple[tuple[str, str], ...] = ()  # (operator, target)

    @property
    def name(self) -> str:
        return self.words[0] if self.words else ""

    def text(self) -> str:
        """The command as one line: words, then redirections (``> target``)."""
        return " ".join([*self.words, *(f"{op} {target}" for op, target in self.redirects)])


@dataclass
class ParsedShell:
    commands: list[SimpleCommand] = field(default_factory=list)
    pipelines: list[tuple[str, ...]] = field(default_factory=list)  # command names, two or more
    signals: list[tuple[str, str]] = field(default_factory=list)  # (kind, detail)
    # files the command writes (>, tee, cp …) -> their text when it is known
    written: dict[str, str | None] = field(default_factory=dict)
    # the step's own stdin, and the program (shell or interpreter) that reads
    # its program from it, if one does
    stdin: str | None = None
    stdin_program: str = ""
    # texts() as last built, and the (commands, pipelines) counts it was built at
    _texts: tuple[tuple[int, int], list[str]] | None = field(default=None, repr=False, compare=False)

    def texts(self) -> list[str]:
        """What a rule on the ``words`` field searches: each simple command,
        and each pipeline as its command names joined by `` | ``. Built once
        for every rule that reads it: the parser only ever appends (simple
        commands are immutable), so the counts tell when it is out of date."""
        at = (len(self.commands), len(self.pipelines))
        if self._texts is None or self._texts[0] != at:
            self._texts = at, ([command.text() for command in self.commands]
                               + [" | ".join(names) for names in self.pipelines])
        return self._texts[1]

    def signal(self, kind: str, detail: str) -> None:
        if (kind, detail) not in self.signals:
            self.signals.append((kind, detail))


@dataclass
class Word:
    value: str  # quotes removed, known variables substituted
    raw: str  # as written
    expanded: bool = False  # holds a parameter, command or process substitution



@dataclass
class Context:
    parsed: ParsedShell
    # how a nested script (sh -c, eval, a file the step wrote …) is parsed: policy.shell_words' script walk
    parse: Callable[[str, Context], None]
    env: dict[str, str | None] = field(default_factory=dict)  # literal assignments seen so far; None: unknown
    depth: int = 0
    stdin_text: str | None = None  # what the previous command of a pipeline prints, when it is plain text

    def deeper(self, *, env: dict[str, str | None] | None = None, stdin_text: str | None = None) -> Context:
        """The context of a command nested in this one."""
        return replace(self, env=self.env if env is None else env, depth=self.depth + 1, stdin_text=stdin_text)
