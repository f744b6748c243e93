"""What a shell step would run, as the policy's rules see it: every simple
command with its words normalised, and what could not be resolved.

A script is parsed with ``bashlex`` (a port of bash's own parser); what it
cannot parse is split into words with ``shlex`` and reported as unresolved.
An argv step is its own argv. Each simple command of a list, pipeline,
subshell, loop, function or command substitution is reported separately:

- quotes are removed (``s''udo`` is ``sudo``) and the command word is its
  basename (``/usr/bin/sudo`` is ``sudo``);
- a variable assigned a literal earlier in the script is substituted
  (``R=/; rm -rf $R`` is ``rm -rf /``);
- wrappers are looked through (``env X=1 cmd``, ``nohup``, ``timeout 5 cmd``,
  ``xargs cmd``, ``find … -exec cmd``, ``busybox cmd``, ``sudo cmd``), and
  ``sh -c '…'`` / ``bash -c`` / ``eval`` / ``watch`` scripts are parsed in turn;
  the wrapper and what it runs are both reported;
- redirections stay with their command (``cat x > /dev/sda``).

A step's own stdin (``stdin``) goes to whatever reads it: when that is a
shell or an interpreter reading its program from it (``sh``, ``bash -s``,
``python3 -``, ``perl``, ``xargs sh`` …), the text is the program, parsed
here as a script would be, and ``stdin_program`` names who runs it.

``signals`` says what the words cannot show: a command word that is a
variable or a substitution, a command word spelt with quotes or globs,
``eval``/``exec``/``source``, a shell or an interpreter reading its program
from a pipe or a here-document (``unresolvable``), and an interpreter given
code inline (``python -c``, ``perl -e``, ``node -e``: ``inline_code``).

This module only reads text: it never runs anything.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

import bashlex

UNRESOLVABLE = "unresolvable"
INLINE_CODE = "inline_code"
MAX_DEPTH = 8  # nested sh -c / eval / wrappers; deeper is itself a signal

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox-sh", "fish", "csh", "tcsh", "rbash"})
# interpreter -> the options that take the program text itself
INLINE_OPTIONS = {
    "python": {"-c"}, "perl": {"-e", "-E"}, "ruby": {"-e"}, "node": {"-e", "--eval", "-p", "--print"},
    "nodejs": {"-e", "--eval", "-p", "--print"}, "php": {"-r"}, "lua": {"-e"}, "deno": {"eval"},
    "bun": {"-e", "--eval"}, "tclsh": set(), "rscript": {"-e"}, "pwsh": {"-c", "-command"},
    "osascript": {"-e"},
}
INTERPRETER_RE = re.compile(r"^(?:python[0-9.]*|pypy[0-9.]*|perl[0-9.]*|ruby[0-9.]*|node|nodejs|php[0-9.]*|lua[0-9.]*"
                            r"|deno|bun|tclsh[0-9.]*|rscript|pwsh|osascript|jshell|irb)$", re.IGNORECASE)
# wrapper -> (options that take a value, positional arguments before the command)
WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "env": (frozenset({"-u", "--unset", "-C", "--chdir"}), 0),
    "nohup": (frozenset(), 0),
    "setsid": (frozenset(), 0),
    "time": (frozenset({"-f", "--format", "-o", "--output"}), 0),
    "timeout": (frozenset({"-s", "--signal", "-k", "--kill-after"}), 1),
    "nice": (frozenset({"-n", "--adjustment"}), 0),
    "ionice": (frozenset({"-c", "--class", "-n", "--classdata", "-p", "--pid"}), 0),
    "chrt": (frozenset(), 1),
    "taskset": (frozenset(), 1),
    "stdbuf": (frozenset({"-i", "-o", "-e", "--input", "--output", "--error"}), 0),
    "xargs": (frozenset({"-a", "--arg-file", "-d", "--delimiter", "-E", "-I", "-L", "--max-lines", "-n",
                         "--max-args", "-P", "--max-procs", "-s", "--max-chars", "--process-slot-var"}), 0),
    "sudo": (frozenset({"-u", "--user", "-g", "--group", "-C", "--close-from", "-D", "--chdir", "-h", "--host",
                        "-p", "--prompt", "-r", "--role", "-t", "--type", "-T", "--command-timeout", "-U",
                        "--other-user"}), 0),
    "doas": (frozenset({"-u", "-C"}), 0),
    "pkexec": (frozenset({"--user"}), 0),
    "command": (frozenset(), 0),
    "builtin": (frozenset(), 0),
    "exec": (frozenset({"-a"}), 0),
    "busybox": (frozenset(), 0),
    "toybox": (frozenset(), 0),
    "unbuffer": (frozenset(), 0),
    "fakeroot": (frozenset(), 0),
    "strace": (frozenset({"-e", "-o", "-p", "-s", "-u", "-E", "-P"}), 0),
    "ltrace": (frozenset({"-e", "-o", "-p", "-s", "-u", "-n"}), 0),
    "flock": (frozenset({"-w", "--timeout", "-E", "--conflict-exit-code"}), 1),
    "chroot": (frozenset({"--userspec", "--groups"}), 1),
    "runuser": (frozenset({"-u", "--user", "-g", "--group", "-G"}), 0),
    "catchsegv": (frozenset(), 0),
    # the dynamic loader runs any binary given to it: /lib64/ld-linux-x86-64.so.2 /usr/bin/sudo
    "ld.so": (frozenset({"--library-path", "--preload", "--argv0", "--audit", "--inhibit-rpath"}), 0),
}
# commands that run their arguments as a script (sh -c "$*")
SCRIPT_RUNNERS = frozenset({"eval", "watch"})
SOURCE_COMMANDS = frozenset({"source", "."})
# eval/exec/source/alias hide what runs from a reader of the text
OPAQUE_COMMANDS = frozenset({"eval", "exec", "source", ".", "alias"})
# commands that run the value of their -c option as a shell command line
DASH_C_RUNNERS = frozenset({"script", "flock", "su", "runuser", "sg"})
LOADER_RE = re.compile(r"^ld(?:-linux[\w.-]*|-musl[\w.-]*)?\.so(?:\.\d+)*$")
FIND_EXEC = frozenset({"-exec", "-execdir", "-ok", "-okdir"})
ASSIGNMENT_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
PARAMETER_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
GLOB_CHARS = frozenset("*?[{")
RESERVED_WORDS = frozenset({"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "for", "case", "esac",
                            "in", "{", "}", "!", "function", "select", "time", "coproc", "[[", "]]"})


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

    def texts(self) -> list[str]:
        """What a rule on the ``words`` field searches: each simple command,
        and each pipeline as its command names joined by `` | ``."""
        return [command.text() for command in self.commands] + [" | ".join(names) for names in self.pipelines]

    def signal(self, kind: str, detail: str) -> None:
        if (kind, detail) not in self.signals:
            self.signals.append((kind, detail))


@dataclass
class _Word:
    value: str  # quotes removed, known variables substituted
    raw: str  # as written
    expanded: bool = False  # holds a parameter, command or process substitution


@dataclass
class _Context:
    parsed: ParsedShell
    env: dict[str, str | None] = field(default_factory=dict)  # literal assignments seen so far; None: unknown
    depth: int = 0
    stdin_text: str | None = None  # what the previous command of a pipeline prints, when it is plain text


def parse_script(script: str, *, stdin: str | None = None) -> ParsedShell:
    parsed = ParsedShell(stdin=stdin)
    _script(script, _Context(parsed))
    return parsed


def parse_argv(argv: list[str], *, stdin: str | None = None) -> ParsedShell:
    """An argv step: executed without a shell, so only wrappers and
    ``sh -c`` scripts are resolved."""
    parsed = ParsedShell(stdin=stdin)
    words = [_Word(str(arg), str(arg)) for arg in argv]
    if words:
        _command(words, [], _Context(parsed), piped=False, from_script=False)
    return parsed


# --- scripts ------------------------------------------------------------------


def _script(script: str, ctx: _Context) -> None:
    if ctx.depth > MAX_DEPTH:
        ctx.parsed.signal(UNRESOLVABLE, f"commands nested deeper than {MAX_DEPTH} levels")
        return
    if not script.strip():
        return
    try:
        trees = bashlex.parse(script)
    # bashlex raises ParsingError, NotImplementedError (case, arithmetic,
    # [[ ]]) and, on hostile input, whatever its internals hit
    # (RecursionError, IndexError …): every one means "not understood here",
    # which the fallback below reports as unresolved rather than letting
    # a crafted script break the policy gate.
    except Exception as exc:  # noqa: BLE001
        ctx.parsed.signal(UNRESOLVABLE, f"the shell parser could not parse the script ({type(exc).__name__}: "
                                        f"{str(exc)[:120]})")
        _fallback(script, ctx)
        return
    try:
        for tree in trees:
            _node(tree, script, ctx)
    except RecursionError:
        ctx.parsed.signal(UNRESOLVABLE, "the script nests deeper than the policy follows")


def _node(node, script: str, ctx: _Context, *, piped: bool = False) -> list[str]:
    """Walk one bashlex node; returns the names of the commands it ran last
    (for pipelines)."""
    kind = node.kind
    if kind == "command":
        return _command_node(node, script, ctx, piped=piped)
    if kind == "pipeline":
        names: list[str] = []
        parts = [part for part in node.parts if part.kind != "pipe"]
        for index, part in enumerate(parts):
            ctx.stdin_text = (_stdin_text(ctx.parsed.commands[-1], ctx.parsed.stdin)
                              if index and ctx.parsed.commands else None)
            ran = _node(part, script, ctx, piped=piped or index > 0)
            ctx.stdin_text = None
            names.append(ran[-1] if ran else "?")
        if len(names) > 1:
            ctx.parsed.pipelines.append(tuple(names))
        return names[-1:]
    if kind == "for":
        words = [part for part in node.parts if part.kind == "word"]
        items = [_word(part, script, ctx) for part in words[1:]]
        if words:
            # The loop variable stands for all its items at once, so a rule
            # sees `rm -rf / /home` for `for d in / /home; do rm -rf $d; done`.
            literal = items and not any(item.expanded for item in items)
            ctx.env[words[0].word] = " ".join(item.value for item in items) if literal else None
    if kind == "word":
        _substitutions(node, script, ctx)
        return []
    ran: list[str] = []
    for child in [*getattr(node, "parts", []), *getattr(node, "list", [])]:
        if child.kind in ("operator", "reservedword", "pipe"):
            continue
        if kind == "for" and child.kind == "word":
            continue
        ran = _node(child, script, ctx, piped=piped) or ran
    for redirect in getattr(node, "redirects", []) or []:
        _redirect(redirect, script, ctx)
    return ran


def _substitutions(node, script: str, ctx: _Context) -> bool:
    """Walk the command and process substitutions inside a word; True when it has any expansion."""
    expanded = False
    for part in getattr(node, "parts", []) or []:
        if part.kind in ("commandsubstitution", "processsubstitution"):
            expanded = True
            inner = _Context(ctx.parsed, dict(ctx.env), ctx.depth + 1)
            _node(part.command, script, inner)
        elif part.kind == "parameter":
            expanded = True
        elif part.kind == "tilde":
            continue
        else:
            expanded = _substitutions(part, script, ctx) or expanded
    return expanded


def _substitute(value: str, env: dict[str, str | None]) -> str:
    def known(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        literal = env.get(name)
        return literal if literal is not None else match.group(0)

    return PARAMETER_RE.sub(known, value)


def _word(node, script: str, ctx: _Context) -> _Word:
    raw = script[node.pos[0]:node.pos[1]]
    expanded = _substitutions(node, script, ctx)
    has_parameter = any(part.kind == "parameter" for part in getattr(node, "parts", []) or [])
    value = _substitute(node.word, ctx.env) if has_parameter else node.word
    return _Word(value, raw, expanded)


def _redirect(node, script: str, ctx: _Context) -> tuple[str, str] | None:
    if getattr(node, "heredoc", None) is not None:
        body = node.heredoc.value.rsplit("\n", 1)[0] if "\n" in node.heredoc.value else ""
        return ("<<", body)
    target = node.output
    if isinstance(target, int):
        return None  # 2>&1: a descriptor, not a path
    word = _word(target, script, ctx)
    return (node.type, word.value)


def _command_node(node, script: str, ctx: _Context, *, piped: bool) -> list[str]:
    words: list[_Word] = []
    redirects: list[tuple[str, str]] = []
    assignments: list[tuple[str, _Word]] = []
    for part in node.parts:
        if part.kind == "assignment":
            word = _word(part, script, ctx)
            match = ASSIGNMENT_RE.match(word.value)
            if match and not words:
                assignments.append((match.group(1), _Word(match.group(2), word.raw, word.expanded)))
            elif match:
                words.append(word)  # export-like: NAME=value after the command word is an argument
        elif part.kind == "word":
            words.append(_word(part, script, ctx))
        elif part.kind == "redirect":
            redirect = _redirect(part, script, ctx)
            if redirect is not None:
                redirects.append(redirect)
    if not words:
        for name, value in assignments:
            # A literal (or one made of literals) is followed; anything else is unknown.
            substituted = "$(" in value.raw or "`" in value.raw or PARAMETER_RE.search(value.value)
            ctx.env[name] = None if substituted else value.value
        if redirects:
            ctx.parsed.commands.append(SimpleCommand((), tuple(redirects)))
        return []
    return _command(words, redirects, ctx, piped=piped, from_script=True)


def _command(words: list[_Word], redirects: list[tuple[str, str]], ctx: _Context, *, piped: bool,
             from_script: bool) -> list[str]:
    """Record one simple command (and what it wraps); returns the names run."""
    head = words[0]
    if from_script:
        if head.expanded or "$" in head.raw or "`" in head.raw:
            ctx.parsed.signal(UNRESOLVABLE, f"the command word is a variable or a substitution ({head.raw[:80]})")
        elif head.raw != head.value and any(char in head.raw for char in "'\"\\") and not _wholly_quoted(head.raw):
            ctx.parsed.signal(UNRESOLVABLE, f"the command word is spelt with quotes or escapes "
                                            f"({head.raw[:80]} is {head.value[:80]})")
        if GLOB_CHARS & set(head.value) and head.raw == head.value:
            ctx.parsed.signal(UNRESOLVABLE, f"the command word is a glob or brace pattern ({head.raw[:80]})")
    name = os.path.basename(head.value) if "/" in head.value.rstrip("/") else head.value
    values = [name, *(word.value for word in words[1:])]
    command = SimpleCommand(tuple(values), tuple(redirects))
    ctx.parsed.commands.append(command)
    ran = [name]
    if ctx.depth >= MAX_DEPTH:
        ctx.parsed.signal(UNRESOLVABLE, f"commands nested deeper than {MAX_DEPTH} levels")
        return ran
    inner = _Context(ctx.parsed, ctx.env, ctx.depth + 1, ctx.stdin_text)
    args = words[1:]
    if "/" in head.value:
        _run_written(head.value, head.value, inner, as_shell=True)
    _record_writes(command, ctx)
    key = "ld.so" if LOADER_RE.match(name) else name.lower()
    if key in OPAQUE_COMMANDS:
        ctx.parsed.signal(UNRESOLVABLE, f"{name} hides what runs from the policy")
    if key in SOURCE_COMMANDS:
        if args:
            _run_written(args[0].value, name, inner, as_shell=True)
        return ran
    if key == "alias":
        # dash expands aliases in scripts too: `alias x=sudo; x id` runs sudo
        for word in args:
            match = ASSIGNMENT_RE.match(word.value)
            if match:
                _script(match.group(2), inner)
        return ran
    if key in DASH_C_RUNNERS:
        for index, word in enumerate(args[:-1]):
            if word.value == "--command" or re.fullmatch(r"-[A-Za-z]*c", word.value):
                _script(args[index + 1].value, inner)
    if key in SCRIPT_RUNNERS:
        script_args = _skip_options(args, frozenset({"-n", "--interval"})) if key == "watch" else args
        if any(word.expanded for word in script_args):
            ctx.parsed.signal(UNRESOLVABLE, f"{name} runs text the policy cannot see ({_raw(script_args)})")
        _script(" ".join(word.value for word in script_args), inner)
        return ran
    if key in WRAPPERS:
        rest = _unwrap(key, args, inner)
        if key == "xargs" and rest:
            fed = os.path.basename(rest[0].value)
            if fed in WRAPPERS or fed in SHELLS or fed in SCRIPT_RUNNERS or INTERPRETER_RE.match(fed):
                ctx.parsed.signal(UNRESOLVABLE, f"xargs feeds its input to {fed}: what runs comes from the input")
        if rest:
            ran.extend(_command(rest, [], inner, piped=piped, from_script=from_script))
        return ran
    if key == "find":
        _find_exec(args, inner, from_script=from_script)
        return ran
    if key in SHELLS or key == "busybox-sh":
        _shell(name, args, redirects, inner, piped=piped)
        return ran
    if INTERPRETER_RE.match(name):
        _interpreter(name, args, redirects, ctx, piped=piped)
    return ran


def _wholly_quoted(raw: str) -> bool:
    """``"/opt/my tool/run"``: one quoted string, which changes no letter of the word."""
    return len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" and raw[0] not in raw[1:-1] and "\\" not in raw


def _raw(words: list[_Word]) -> str:
    return " ".join(word.raw for word in words)[:80]


def _skip_options(args: list[_Word], with_value: frozenset[str]) -> list[_Word]:
    index = 0
    while index < len(args):
        value = args[index].value
        if value == "--":
            return args[index + 1:]
        if not value.startswith("-") or value == "-":
            break
        index += 2 if value in with_value else 1
    return args[index:]


def _unwrap(name: str, args: list[_Word], ctx: _Context) -> list[_Word]:
    with_value, positionals = WRAPPERS[name]
    if name == "env":
        for index, word in enumerate(args):
            if word.value in ("-S", "--split-string") and index + 1 < len(args):
                return _split(args[index + 1], ctx) + args[index + 2:]
            if word.value.startswith(("-S", "--split-string=")) and len(word.value) > 2:
                text = word.value.split("=", 1)[1] if word.value.startswith("--") else word.value[2:]
                return _split(_Word(text, word.raw, word.expanded), ctx) + args[index + 1:]
    rest = _skip_options(args, with_value)
    if name in ("env", "sudo", "doas", "runuser"):
        while rest and ASSIGNMENT_RE.match(rest[0].value):
            rest = rest[1:]
    return rest[positionals:]


def _split(word: _Word, ctx: _Context) -> list[_Word]:
    try:
        parts = shlex.split(word.value)
    except ValueError:
        ctx.parsed.signal(UNRESOLVABLE, f"unbalanced quotes in {word.raw[:80]}")
        parts = word.value.split()
    return [_Word(part, part) for part in parts]


def _find_exec(args: list[_Word], ctx: _Context, *, from_script: bool) -> None:
    index = 0
    while index < len(args):
        if args[index].value in FIND_EXEC:
            end = index + 1
            while end < len(args) and args[end].value not in (";", "+"):
                end += 1
            if end > index + 1:
                _command(args[index + 1:end], [], ctx, piped=False, from_script=from_script)
            index = end
        index += 1


def _shell(name: str, args: list[_Word], redirects: list[tuple[str, str]], ctx: _Context, *, piped: bool) -> None:
    skip = False
    for index, word in enumerate(args):
        value = word.value
        if skip:
            skip = False
            continue
        if value == "--":
            break
        if value in ("-o", "+o", "-O", "+O", "--rcfile", "--init-file"):
            skip = True
            continue
        if value.startswith("-") and not value.startswith("--") and "s" in value[1:] and "c" not in value[1:]:
            break  # -s: the program is read from stdin, the words after it are its arguments
        if value.startswith("-") and len(value) > 1 and not value.startswith("--") and "c" in value[1:]:
            rest = args[index + 1:]
            if rest and rest[0].value == "--":
                rest = rest[1:]
            if not rest:
                ctx.parsed.signal(UNRESOLVABLE, f"{name} -c without its command line here: it comes from elsewhere")
                return
            script = rest[0]
            if script.expanded or "{}" in script.value:
                ctx.parsed.signal(UNRESOLVABLE, f"{name} -c runs text the policy cannot see ({script.raw[:80]})")
            _script(script.value, ctx)
            return
        if not value.startswith(("-", "+")):
            if word.expanded:
                ctx.parsed.signal(UNRESOLVABLE, f"{name} runs a script the policy cannot see ({word.raw[:80]})")
            _run_written(value, name, ctx, as_shell=True)
            return  # runs a script file
    _stdin_program(name, redirects, ctx, piped=piped)


def _inline_option(value: str, options: set[str]) -> bool:
    """``-c``, ``-ne`` (a cluster ending in the option) or ``-cCODE`` (code attached)."""
    if value in options:
        return True
    for option in options:
        if len(option) == 2 and option.startswith("-") and not value.startswith("--"):
            letter = option[1]
            if re.fullmatch(rf"-[A-Za-z]*{letter}", value) or (value.startswith(option) and len(value) > 2):
                return True
    return False


def _interpreter(name: str, args: list[_Word], redirects: list[tuple[str, str]], ctx: _Context, *,
                 piped: bool) -> None:
    family = re.sub(r"[0-9.]+$", "", name.lower())
    options = INLINE_OPTIONS.get(family, set())
    for word in args:
        value = word.value
        if _inline_option(value, options):
            ctx.parsed.signal(INLINE_CODE, f"{name} {value[:12]} runs code given inline")
            return
        if value == "-":
            break
        if value in ("-m", "-M") or not value.startswith("-"):
            if word.expanded:
                ctx.parsed.signal(UNRESOLVABLE, f"{name} runs a program the policy cannot see ({word.raw[:80]})")
            if not value.startswith("-"):
                _run_written(value, name, ctx, as_shell=False)
            return  # a script file or a module
    _stdin_program(name, redirects, ctx, piped=piped)


WRITE_REDIRECTS = frozenset({">", ">>", ">|", "&>", "&>>"})
COPIERS = frozenset({"cp", "mv", "ln", "install", "rsync"})


def _file_key(path: str) -> str:
    return os.path.normpath(path)


def _record_writes(command: SimpleCommand, ctx: _Context) -> None:
    """Remember the files a command writes, with their text when it is
    plain (``echo … >``, ``printf … >``, ``cat <<EOF >``), so that running
    one later is followed, or signalled."""
    written = ctx.parsed.written
    text = _stdin_text(command) if command.name in ("echo", "printf", "cat") else None
    targets = [target for op, target in command.redirects if op in WRITE_REDIRECTS]
    if command.name == "tee":
        text = ctx.stdin_text
        targets += [word for word in command.words[1:] if not word.startswith("-")]
    if command.name in ("curl", "wget"):
        for index, word in enumerate(command.words[1:-1], start=1):
            if word in ("-o", "-O", "--output", "--output-document"):
                targets.append(command.words[index + 1])
    if command.name in COPIERS:
        operands = [word for word in command.words[1:] if not word.startswith("-")]
        if len(operands) >= 2:
            targets.append(operands[-1])
    for target in targets:
        key = _file_key(target)
        appending = any(op in (">>", "&>>") and target == path for op, path in command.redirects)
        if appending and key in written:
            before = written[key]
            written[key] = None if before is None or text is None else before + "\n" + text
        else:
            written[key] = text


def _run_written(path: str, runner: str, ctx: _Context, *, as_shell: bool) -> None:
    key = _file_key(path)
    if key not in ctx.parsed.written:
        return
    text = ctx.parsed.written[key]
    if as_shell and text is not None:
        _script(text, ctx)  # what the step wrote is what it runs
        return
    ctx.parsed.signal(UNRESOLVABLE, f"{runner} runs {path}, a file this step writes: the policy does not read it")


def _stdin_text(upstream: SimpleCommand, step_stdin: str | None = None) -> str | None:
    """What ``echo …``, ``printf …`` or ``cat <<EOF`` prints into a pipe (a
    bare ``cat``: the step's own stdin)."""
    if upstream.name in ("echo", "printf"):
        return " ".join(word for word in upstream.words[1:] if not word.startswith("-"))
    if upstream.name == "cat":
        bodies = [target for op, target in upstream.redirects if op in ("<<", "<<-", "<<<")]
        if not bodies and all(word == "-" for word in upstream.words[1:]) and not upstream.redirects:
            return step_stdin
        return "\n".join(bodies) or None
    return None


def _stdin_program(name: str, redirects: list[tuple[str, str]], ctx: _Context, *, piped: bool) -> None:
    heredocs = [target for op, target in redirects if op in ("<<", "<<-", "<<<")]
    if heredocs:
        ctx.parsed.signal(UNRESOLVABLE, f"{name} reads its program from a here-document")
        if name.lower() in SHELLS:
            for body in heredocs:
                _script(body, ctx)
    elif piped:
        ctx.parsed.signal(UNRESOLVABLE, f"{name} reads its program from a pipe")
        if ctx.stdin_text is not None and ctx.stdin_text is ctx.parsed.stdin and not ctx.parsed.stdin_program:
            ctx.parsed.stdin_program = name  # `cat | sh`: the step's own stdin, passed on
        if name.lower() in SHELLS and ctx.stdin_text:
            _script(ctx.stdin_text, ctx)
    elif any(op == "<" for op, _target in redirects):
        ctx.parsed.signal(UNRESOLVABLE, f"{name} reads its program from a redirected file")
    elif ctx.parsed.stdin is not None and not ctx.parsed.stdin_program:
        # The step's own stdin, and the first reader takes it: its text is
        # the program, rated as that program given as a script (or inline).
        ctx.parsed.stdin_program = name
        if name.lower() in SHELLS:
            _script(ctx.parsed.stdin, ctx)
        else:
            ctx.parsed.signal(INLINE_CODE, f"{name} runs the program fed on its stdin")


# --- what bashlex cannot parse ------------------------------------------------------


def _fallback(script: str, ctx: _Context) -> None:
    """Split into words with shlex and cut at the shell's operators: the
    rules still see every command word, without structure."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:
        tokens = script.split()
    segment: list[str] = []
    segments: list[list[str]] = []
    for token in tokens:
        if token and set(token) <= set(";&|()"):
            segments.append(segment)
            segment = []
        else:
            segment.append(token)
    segments.append(segment)
    for tokens_of_command in segments:
        while tokens_of_command and tokens_of_command[0] in RESERVED_WORDS:
            tokens_of_command = tokens_of_command[1:]
        words, redirects = [], []
        index = 0
        while index < len(tokens_of_command):
            token = tokens_of_command[index]
            if token and set(token) <= set("<>&|") and set(token) & set("<>"):
                target = tokens_of_command[index + 1] if index + 1 < len(tokens_of_command) else ""
                redirects.append((token, target))
                index += 2
                continue
            words.append(_Word(token, token, "$" in token or "`" in token))
            index += 1
        while words and ASSIGNMENT_RE.match(words[0].value):
            words = words[1:]
        if words:
            _command(words, redirects, ctx, piped=False, from_script=True)
        elif redirects:
            ctx.parsed.commands.append(SimpleCommand((), tuple(redirects)))
