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

import re
import shlex

from policy.shell_commands import ASSIGNMENT_RE, INLINE_OPTIONS, PARAMETER_RE, SHELLS, read_command, stdin_text
from policy.shell_parsed import INLINE_CODE, MAX_DEPTH, UNRESOLVABLE, Context, ParsedShell, SimpleCommand, Word

__all__ = ["INLINE_CODE", "INLINE_OPTIONS", "SHELLS", "UNRESOLVABLE", "ParsedShell", "SimpleCommand", "parse_argv",
           "parse_script"]

RESERVED_WORDS = frozenset({"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "for", "case", "esac",
                            "in", "{", "}", "!", "function", "select", "time", "coproc", "[[", "]]"})



def parse_script(script: str, *, stdin: str | None = None) -> ParsedShell:
    parsed = ParsedShell(stdin=stdin)
    _script(script, Context(parsed, parse=_script))
    return parsed


def parse_argv(argv: list[str], *, stdin: str | None = None) -> ParsedShell:
    """An argv step: executed without a shell, so only wrappers and
    ``sh -c`` scripts are resolved."""
    parsed = ParsedShell(stdin=stdin)
    words = [Word(str(arg), str(arg)) for arg in argv]
    if words:
        read_command(words, [], Context(parsed, parse=_script), piped=False, from_script=False)
    return parsed


# --- scripts ------------------------------------------------------------------


def _script(script: str, ctx: Context) -> None:
    if ctx.depth > MAX_DEPTH:
        ctx.parsed.signal(UNRESOLVABLE, f"commands nested deeper than {MAX_DEPTH} levels")
        return
    if not script.strip():
        return
    # Imported on first use: bashlex builds its parser's tables as it is
    # imported (a tenth of a second and more), which a process that never
    # reads a script (most web requests, manage.py) need not pay.
    import bashlex

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


def _node(node, script: str, ctx: Context, *, piped: bool = False) -> list[str]:
    """Walk one bashlex node; returns the names of the commands it ran last
    (for pipelines)."""
    kind = node.kind
    if kind == "command":
        return _command_node(node, script, ctx, piped=piped)
    if kind == "pipeline":
        names: list[str] = []
        parts = [part for part in node.parts if part.kind != "pipe"]
        for index, part in enumerate(parts):
            ctx.stdin_text = (stdin_text(ctx.parsed.commands[-1], ctx.parsed.stdin)
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


def _substitutions(node, script: str, ctx: Context) -> bool:
    """Walk the command and process substitutions inside a word; True when it has any expansion."""
    expanded = False
    for part in getattr(node, "parts", []) or []:
        if part.kind in ("commandsubstitution", "processsubstitution"):
            expanded = True
            inner = ctx.deeper(env=dict(ctx.env))
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


def _word(node, script: str, ctx: Context) -> Word:
    raw = script[node.pos[0]:node.pos[1]]
    expanded = _substitutions(node, script, ctx)
    has_parameter = any(part.kind == "parameter" for part in getattr(node, "parts", []) or [])
    value = _substitute(node.word, ctx.env) if has_parameter else node.word
    return Word(value, raw, expanded)


def _redirect(node, script: str, ctx: Context) -> tuple[str, str] | None:
    if getattr(node, "heredoc", None) is not None:
        body = node.heredoc.value.rsplit("\n", 1)[0] if "\n" in node.heredoc.value else ""
        return ("<<", body)
    target = node.output
    if isinstance(target, int):
        return None  # 2>&1: a descriptor, not a path
    word = _word(target, script, ctx)
    return (node.type, word.value)


def _command_node(node, script: str, ctx: Context, *, piped: bool) -> list[str]:
    words: list[Word] = []
    redirects: list[tuple[str, str]] = []
    assignments: list[tuple[str, Word]] = []
    for part in node.parts:
        if part.kind == "assignment":
            word = _word(part, script, ctx)
            match = ASSIGNMENT_RE.match(word.value)
            if match and not words:
                assignments.append((match.group(1), Word(match.group(2), word.raw, word.expanded)))
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
    return read_command(words, redirects, ctx, piped=piped, from_script=True)


# --- what bashlex cannot parse ------------------------------------------------------


def _fallback(script: str, ctx: Context) -> None:
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
            words.append(Word(token, token, "$" in token or "`" in token))
            index += 1
        while words and ASSIGNMENT_RE.match(words[0].value):
            words = words[1:]
        if words:
            read_command(words, redirects, ctx, piped=False, from_script=True)
        elif redirects:
            ctx.parsed.commands.append(SimpleCommand((), tuple(redirects)))
