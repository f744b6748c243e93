"""What a simple command runs, as the policy reads it: the command word's
basename, what wrappers (``env``, ``sudo``, ``xargs``, ``find -exec`` …)
run, the scripts shells and ``eval`` are given, interpreters given code
inline, files the command writes and then runs, and programs read from
stdin (docs/policy.md, "Parsed command and signals")."""

from __future__ import annotations

import os
import re
import shlex

from policy.shell_parsed import INLINE_CODE, MAX_DEPTH, UNRESOLVABLE, Context, SimpleCommand, Word

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


def read_command(words: list[Word], redirects: list[tuple[str, str]], ctx: Context, *, piped: bool,
                 from_script: bool) -> list[str]:
    """Record one simple command (and what it wraps); returns the names run."""
    head = words[0]
    if from_script:
        _check_command_word(head, ctx)
    name = os.path.basename(head.value) if "/" in head.value.rstrip("/") else head.value
    values = [name, *(word.value for word in words[1:])]
    command = SimpleCommand(tuple(values), tuple(redirects))
    ctx.parsed.commands.append(command)
    ran = [name]
    if ctx.depth >= MAX_DEPTH:
        ctx.parsed.signal(UNRESOLVABLE, f"commands nested deeper than {MAX_DEPTH} levels")
        return ran
    inner = ctx.deeper(stdin_text=ctx.stdin_text)
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
        for match in filter(None, (ASSIGNMENT_RE.match(word.value) for word in args)):
            ctx.parse(match.group(2), inner)
        return ran
    if key in DASH_C_RUNNERS:
        for index, word in enumerate(args[:-1]):
            if word.value == "--command" or re.fullmatch(r"-[A-Za-z]*c", word.value):
                ctx.parse(args[index + 1].value, inner)
    if key in SCRIPT_RUNNERS:
        script_args = _skip_options(args, frozenset({"-n", "--interval"})) if key == "watch" else args
        if any(word.expanded for word in script_args):
            ctx.parsed.signal(UNRESOLVABLE, f"{name} runs text the policy cannot see ({_raw(script_args)})")
        ctx.parse(" ".join(word.value for word in script_args), inner)
        return ran
    if key in WRAPPERS:
        rest = _unwrap(key, args, inner)
        if key == "xargs" and rest:
            fed = os.path.basename(rest[0].value)
            if fed in WRAPPERS or fed in SHELLS or fed in SCRIPT_RUNNERS or INTERPRETER_RE.match(fed):
                ctx.parsed.signal(UNRESOLVABLE, f"xargs feeds its input to {fed}: what runs comes from the input")
        if rest:
            ran.extend(read_command(rest, [], inner, piped=piped, from_script=from_script))
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


def _check_command_word(head: Word, ctx: Context) -> None:
    """Signal a command word of a script that its text does not show."""
    if head.expanded or "$" in head.raw or "`" in head.raw:
        ctx.parsed.signal(UNRESOLVABLE, f"the command word is a variable or a substitution ({head.raw[:80]})")
    elif head.raw != head.value and any(char in head.raw for char in "'\"\\") and not _wholly_quoted(head.raw):
        ctx.parsed.signal(UNRESOLVABLE, f"the command word is spelt with quotes or escapes "
                                        f"({head.raw[:80]} is {head.value[:80]})")
    if GLOB_CHARS & set(head.value) and head.raw == head.value:
        ctx.parsed.signal(UNRESOLVABLE, f"the command word is a glob or brace pattern ({head.raw[:80]})")


def _wholly_quoted(raw: str) -> bool:
    """``"/opt/my tool/run"``: one quoted string, which changes no letter of the word."""
    return len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" and raw[0] not in raw[1:-1] and "\\" not in raw


def _raw(words: list[Word]) -> str:
    return " ".join(word.raw for word in words)[:80]


def _skip_options(args: list[Word], with_value: frozenset[str]) -> list[Word]:
    index = 0
    while index < len(args):
        value = args[index].value
        if value == "--":
            return args[index + 1:]
        if not value.startswith("-") or value == "-":
            break
        index += 2 if value in with_value else 1
    return args[index:]


def _unwrap(name: str, args: list[Word], ctx: Context) -> list[Word]:
    with_value, positionals = WRAPPERS[name]
    if name == "env":
        for index, word in enumerate(args):
            if word.value in ("-S", "--split-string") and index + 1 < len(args):
                return _split(args[index + 1], ctx) + args[index + 2:]
            if word.value.startswith(("-S", "--split-string=")) and len(word.value) > 2:
                text = word.value.split("=", 1)[1] if word.value.startswith("--") else word.value[2:]
                return _split(Word(text, word.raw, word.expanded), ctx) + args[index + 1:]
    rest = _skip_options(args, with_value)
    if name in ("env", "sudo", "doas", "runuser"):
        while rest and ASSIGNMENT_RE.match(rest[0].value):
            rest = rest[1:]
    return rest[positionals:]


def _split(word: Word, ctx: Context) -> list[Word]:
    try:
        parts = shlex.split(word.value)
    except ValueError:
        ctx.parsed.signal(UNRESOLVABLE, f"unbalanced quotes in {word.raw[:80]}")
        parts = word.value.split()
    return [Word(part, part) for part in parts]


def _find_exec(args: list[Word], ctx: Context, *, from_script: bool) -> None:
    index = 0
    while index < len(args):
        if args[index].value in FIND_EXEC:
            end = index + 1
            while end < len(args) and args[end].value not in (";", "+"):
                end += 1
            if end > index + 1:
                read_command(args[index + 1:end], [], ctx, piped=False, from_script=from_script)
            index = end
        index += 1


def _shell(name: str, args: list[Word], redirects: list[tuple[str, str]], ctx: Context, *, piped: bool) -> None:
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
            ctx.parse(script.value, ctx)
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


def _interpreter(name: str, args: list[Word], redirects: list[tuple[str, str]], ctx: Context, *,
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


def _record_writes(command: SimpleCommand, ctx: Context) -> None:
    """Remember the files a command writes, with their text when it is
    plain (``echo … >``, ``printf … >``, ``cat <<EOF >``), so that running
    one later is followed, or signalled."""
    written = ctx.parsed.written
    text = stdin_text(command) if command.name in ("echo", "printf", "cat") else None
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


def _run_written(path: str, runner: str, ctx: Context, *, as_shell: bool) -> None:
    key = _file_key(path)
    if key not in ctx.parsed.written:
        return
    text = ctx.parsed.written[key]
    if as_shell and text is not None:
        ctx.parse(text, ctx)  # what the step wrote is what it runs
        return
    ctx.parsed.signal(UNRESOLVABLE, f"{runner} runs {path}, a file this step writes: the policy does not read it")


def stdin_text(upstream: SimpleCommand, step_stdin: str | None = None) -> str | None:
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


def _stdin_program(name: str, redirects: list[tuple[str, str]], ctx: Context, *, piped: bool) -> None:
    heredocs = [target for op, target in redirects if op in ("<<", "<<-", "<<<")]
    if heredocs:
        ctx.parsed.signal(UNRESOLVABLE, f"{name} reads its program from a here-document")
        if name.lower() in SHELLS:
            for body in heredocs:
                ctx.parse(body, ctx)
    elif piped:
        ctx.parsed.signal(UNRESOLVABLE, f"{name} reads its program from a pipe")
        if ctx.stdin_text is not None and ctx.stdin_text is ctx.parsed.stdin and not ctx.parsed.stdin_program:
            ctx.parsed.stdin_program = name  # `cat | sh`: the step's own stdin, passed on
        if name.lower() in SHELLS and ctx.stdin_text:
            ctx.parse(ctx.stdin_text, ctx)
    elif any(op == "<" for op, _target in redirects):
        ctx.parsed.signal(UNRESOLVABLE, f"{name} reads its program from a redirected file")
    elif ctx.parsed.stdin is not None and not ctx.parsed.stdin_program:
        # The step's own stdin, and the first reader takes it: its text is
        # the program, rated as that program given as a script (or inline).
        ctx.parsed.stdin_program = name
        if name.lower() in SHELLS:
            ctx.parse(ctx.parsed.stdin, ctx)
        else:
            ctx.parsed.signal(INLINE_CODE, f"{name} runs the program fed on its stdin")
