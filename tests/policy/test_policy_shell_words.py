"""policy.shell_words: the simple commands a policy rule sees, normalised, and
the signals of what the parser cannot resolve. Only text is parsed here;
nothing is executed."""

import pytest

from policy.shell_words import INLINE_CODE, UNRESOLVABLE, parse_argv, parse_script


@pytest.mark.parametrize(("script", "texts"), [
    ("s''udo id", ["sudo id", "id"]),
    ("/usr/bin/sudo -u root id", ["sudo -u root id", "id"]),
    ("R=/; rm -rf $R", ["rm -rf /"]),
    ("R=/; rm -rf ${R}", ["rm -rf /"]),
    ("R='/'; rm -rf \"$R\"", ["rm -rf /"]),
    ("for d in /srv /home; do rm -rf $d; done", ["rm -rf /srv /home"]),
    ("env A=1 B=2 nice -n 5 ionice -c 3 stdbuf -oL make", [
        "env A=1 B=2 nice -n 5 ionice -c 3 stdbuf -oL make", "nice -n 5 ionice -c 3 stdbuf -oL make",
        "ionice -c 3 stdbuf -oL make", "stdbuf -oL make", "make"]),
    ("timeout -s KILL 5 xargs -I{} cp {} out/", ["timeout -s KILL 5 xargs -I{} cp {} out/", "xargs -I{} cp {} out/",
                                                "cp {} out/"]),
    ("(cd a && ls) | sort > out.txt", ["cd a", "ls", "sort > out.txt", "ls | sort"]),
    ("echo $(id -u) `whoami`", ["id -u", "whoami", "echo $(id -u) `whoami`"]),
    ("sh -c 'echo a; bash -c \"echo b\"'", ["sh -c echo a; bash -c \"echo b\"", "echo a", "bash -c echo b", "echo b"]),
    ("cat x 2>&1 > /dev/sda", ["cat x > /dev/sda"]),
    ("find . -name '*.tmp' -exec rm -f {} \\;", ["find . -name *.tmp -exec rm -f {} ;", "rm -f {}"]),
    ("f() { sudo id; }; f", ["sudo id", "id", "f"]),
    ("if true; then doas id; fi", ["true", "doas id", "id"]),
])
def test_rules_see_each_simple_command_normalised(script, texts):
    assert parse_script(script).texts() == texts


def test_an_argv_step_is_not_shell_parsed_except_through_sh_c():
    literal = parse_argv(["echo", "$P", "s''udo"])
    assert literal.texts() == ["echo $P s''udo"] and literal.signals == []

    nested = parse_argv(["/bin/bash", "-ec", "P=pip; $P install x"])
    assert nested.texts() == ["bash -ec P=pip; $P install x", "pip install x"]
    assert nested.signals == [(UNRESOLVABLE, "the command word is a variable or a substitution ($P)")]


@pytest.mark.parametrize(("script", "signal"), [
    ("$CMD --help", (UNRESOLVABLE, "the command word is a variable or a substitution ($CMD)")),
    ("$(echo ls) -la", (UNRESOLVABLE, "the command word is a variable or a substitution ($(echo ls))")),
    ('"e"cho hi', (UNRESOLVABLE, 'the command word is spelt with quotes or escapes ("e"cho is echo)')),
    ("/bin/ec?o hi", (UNRESOLVABLE, "the command word is a glob or brace pattern (/bin/ec?o)")),
    ("eval echo hi", (UNRESOLVABLE, "eval hides what runs from the policy")),
    ("source ./env.sh", (UNRESOLVABLE, "source hides what runs from the policy")),
    (". ./env.sh", (UNRESOLVABLE, ". hides what runs from the policy")),
    ("exec ls", (UNRESOLVABLE, "exec hides what runs from the policy")),
    ("printf 'ls' | sh", (UNRESOLVABLE, "sh reads its program from a pipe")),
    ("bash -s < job.sh", (UNRESOLVABLE, "bash reads its program from a redirected file")),
    ("python3 <<< 'print(1)'", (UNRESOLVABLE, "python3 reads its program from a here-document")),
    ('sh -c "$JOB"', (UNRESOLVABLE, 'sh -c runs text the policy cannot see ("$JOB")')),
    ("python3 -c 'print(1)'", (INLINE_CODE, "python3 -c runs code given inline")),
    ("python3 -Ic 'print(1)'", (INLINE_CODE, "python3 -Ic runs code given inline")),
    ("perl -lne 'print' f", (INLINE_CODE, "perl -lne runs code given inline")),
    ("ruby -e 'p 1'", (INLINE_CODE, "ruby -e runs code given inline")),
    ("node --eval '1'", (INLINE_CODE, "node --eval runs code given inline")),
    ("php -r 'echo 1;'", (INLINE_CODE, "php -r runs code given inline")),
])
def test_what_the_words_cannot_show_is_signalled(script, signal):
    assert signal in parse_script(script).signals


@pytest.mark.parametrize("script", ["echo hi", "ls -la", "python3 script.py", "grep -r foo .", "python3 -m pytest",
                                    "echo $HOME", '"/opt/my tool/run" --fast', "make -j4 all"])
def test_plain_commands_raise_no_signal(script):
    assert parse_script(script).signals == []


def test_a_here_document_fed_to_a_shell_is_parsed_as_its_program():
    assert "rm -rf /" in parse_script("sh <<EOF\nrm -rf /\nEOF\n").texts()
    assert "sudo id" in parse_script("cat <<EOF | bash\nsudo id\nEOF\n").texts()
    assert "sudo id" in parse_script("echo 'sudo id' | sh").texts()


def test_a_file_the_step_writes_and_then_runs_is_followed_or_signalled():
    followed = parse_script("printf 'sudo id' > job.sh; chmod +x job.sh; ./job.sh")
    assert "sudo id" in followed.texts()
    assert followed.written == {"job.sh": "sudo id"}

    appended = parse_script("echo 'echo a' > j.sh; echo 'sudo id' >> j.sh; sh ./j.sh")
    assert appended.written == {"j.sh": "echo a\nsudo id"} and "sudo id" in appended.texts()

    unknown = parse_script("curl -s https://get.example.com/x -o x.sh; bash x.sh")
    assert (UNRESOLVABLE, "bash runs x.sh, a file this step writes: the policy does not read it") in unknown.signals

    read_only = parse_script("echo data > out.txt; cat out.txt; sh build.sh")
    assert read_only.signals == []  # writing a file is no signal; running one it did not write is not either


@pytest.mark.parametrize("script", [
    "case $x in a) sudo id;; esac",  # bashlex: not implemented
    "a=$((1 + 2)); sudo id",  # arithmetic expansion
    "[[ -f x ]] && sudo id",
    "echo 'unterminated; sudo id",
])
def test_what_bashlex_cannot_parse_is_split_into_words_and_signalled(script):
    parsed = parse_script(script)

    assert parsed.signals[0][0] == UNRESOLVABLE
    assert parsed.signals[0][1].startswith("the shell parser could not parse the script (")
    assert any(text.startswith("sudo id") for text in parsed.texts()) or "unterminated" in script


@pytest.mark.parametrize("script", [
    "(" * 4000 + "echo" + ")" * 4000,
    "echo " + "$(" * 2700 + "x" + ")" * 2700,
    "eval " * 1300 + "id",
    "a | " * 2000 + "b",
    "\x00\x01\x02 \udcff ;;; &&& |||",
    "",
    "   \n\t  ",
])
def test_hostile_input_yields_signals_never_an_exception(script):
    parsed = parse_script(script)

    assert isinstance(parsed.texts(), list)
    if script.strip() and "a | " not in script:
        assert parsed.signals and all(kind in (UNRESOLVABLE, INLINE_CODE) for kind, _ in parsed.signals)


def test_nesting_deeper_than_the_limit_is_signalled():
    parsed = parse_argv(["sh", "-c", "sh -c 'sh -c \"sh -c id\"'"])
    assert "id" in parsed.texts()

    deep = parse_argv(["env"] * 12 + ["sudo", "id"])
    assert (UNRESOLVABLE, "commands nested deeper than 8 levels") in deep.signals
