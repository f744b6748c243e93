"""The default policy: rules with stable names (operators edit them in the
admin; the names are what traces and tests refer to) and policy version 1.

Shell rules search ``command`` (argv joined by spaces, or the script), so a
command is caught whichever way the step spells it. An http request that is
not GET/HEAD is high unless its host is in EXECGO_HTTP_ALLOWED_HOSTS (see
runs.policy). A step no rule matches is low.
"""

from django.db import migrations

# (name, tool, field, pattern, negate, outcome, priority, reason)
SEED_RULES = (
    # --- deny --------------------------------------------------------------
    ("shell-rm-rf-root", "shell", "command",
     r"""\brm\s+(?:[^\s;&|]+\s+)*["']?/\*?["']?(?=$|[\s;&|)])""", False, "deny", 10,
     "deletes the root filesystem (rm of / or /*)"),
    ("shell-no-preserve-root", "shell", "command", r"--no-preserve-root", False, "deny", 11,
     "disables rm's protection of the root filesystem"),
    ("shell-pipe-to-shell", "shell", "command",
     (r"\b(?:curl|wget)\b[^;&\n]*(?<!\|)\|(?!\|)\s*(?:sudo\s+)?(?:\S*/)?(?:(?:ba|da|k|z)?sh|python[0-9.]*|perl|ruby)\b"
      r"|(?:\b(?:ba|da|k|z)?sh|\bsource|(?:^|\s)\.)\s+<\(\s*(?:curl|wget)\b"),
     False, "deny", 12, "runs code downloaded from the network (curl/wget piped into a shell)"),
    ("shell-sudo", "shell", "command", r"\b(?:sudo|doas)\b", False, "deny", 13,
     "privilege escalation (sudo/doas)"),
    ("shell-mkfs", "shell", "command", r"\bmk(?:e2)?fs\b", False, "deny", 14,
     "formats a filesystem"),
    ("shell-dd-to-device", "shell", "command", r"\bdd\b[^;&|\n]*\bof=/dev/(?!(?:null|zero|stdout|stderr|tty)\b|fd/)",
     False, "deny", 15, "writes raw data to a device"),
    ("shell-redirect-to-system-path", "shell", "command",
     (r"""(?:>>?\s*|\btee\b(?:\s+[^\s;&|]+)*?\s+)["']?/(?:(?:etc|bin|sbin|usr|lib|lib32|lib64|boot|root|sys|proc|var"""
      r"""|opt|srv)(?=/|["']?(?:$|[\s;&|)]))|dev/(?!(?:null|zero|stdout|stderr|tty)\b|fd/))"""),
     False, "deny", 16, "writes (> or tee) to a system path outside the workspace"),
    # The system path has to be the last argument: the destination.
    ("shell-copy-to-system-path", "shell", "command",
     (r"""\b(?:cp|mv|install|ln|rsync)\b(?:\s+[^\s;&|]+)*\s+["']?/(?:etc|bin|sbin|usr|lib|lib32|lib64|boot|root|sys"""
      r"""|proc|var|opt|srv)(?:/[^\s;&|"']*)?["']?\s*(?=$|[;&|)])"""),
     False, "deny", 17, "copies or moves files into a system path outside the workspace"),
    # The file tool refuses these paths too; denying them here stops the run
    # before anything executes, and says why in the PolicyDecisionTrace.
    ("file-path-outside-workspace", "file", "path", r"^/|(?:^|/)\.\.(?:/|$)", False, "deny", 18,
     "file paths must stay inside the step's workspace (absolute path or '..')"),
    # --- high: a human approves ---------------------------------------------
    ("shell-package-install", "shell", "command",
     (r"\b(?:apt-get|apt|aptitude|yum|dnf|zypper|brew|pip[0-9.]*|pipx|npm|pnpm|gem|cargo|go)\b(?:\s+-\S+)*\s+install\b"
      r"|\b(?:yarn|pnpm|apk|poetry|uv)\b(?:\s+-\S+)*\s+add\b|\bnpm\s+(?:i|ci)\b"),
     False, "high", 30, "installs packages (changes the host, runs third-party install scripts)"),
    ("http-write-unlisted-host", "http", "method", r"^(?:GET|HEAD)$", True, "high", 31,
     "a request that can change remote state (method not GET/HEAD) to a host not in EXECGO_HTTP_ALLOWED_HOSTS"),
    # --- medium -------------------------------------------------------------
    ("shell-chmod-world-writable", "shell", "command",
     r"\bchmod\s+(?:-\S+\s+)*(?:[0-7]?[0-7]{2}[2367]\b|[ugo]*[ao][ugo]*[+=][rwxXst]*w)",
     False, "medium", 50, "makes files world-writable (chmod 777, o+w)"),
    ("shell-chown", "shell", "command", r"\bch(?:own|grp)\b", False, "medium", 51,
     "changes file ownership"),
    ("shell-network-tool", "shell", "command", r"\b(?:curl|wget|ssh|scp|sftp|rsync|nc|ncat|netcat|telnet)\b",
     False, "medium", 52, "reaches the network from a shell (curl, wget, ssh, scp, …)"),
    # --- low: stated explicitly so traces name the reason ----------------------
    ("http-read", "http", "method", r"^(?:GET|HEAD)$", False, "low", 70,
     "read-only http request (GET/HEAD)"),
    ("file-read-in-workspace", "file", "op", r"^(?:read|list)$", False, "low", 71,
     "reads or lists inside the step's workspace"),
)


def policy_model(apps, name: str):
    """The model as of this migration (the ``runs`` app's), or as it is now
    (the ``policy`` app's: the tests seed the default policy through these
    functions with the live app registry)."""
    try:
        return apps.get_model("runs", name)
    except LookupError:
        return apps.get_model("policy", name)


def seed_policy(apps, schema_editor):
    PolicyRule = policy_model(apps, "PolicyRule")
    PolicyVersion = policy_model(apps, "PolicyVersion")
    for name, tool, field, pattern, negate, outcome, priority, reason in SEED_RULES:
        PolicyRule.objects.get_or_create(name=name, defaults={
            "tool": tool, "field": field, "pattern": pattern, "negate": negate, "outcome": outcome,
            "priority": priority, "reason": reason,
        })
    PolicyVersion.objects.get_or_create(pk=1, defaults={"version": 1})


def unseed_policy(apps, schema_editor):
    PolicyRule = policy_model(apps, "PolicyRule")
    PolicyRule.objects.filter(name__in=[rule[0] for rule in SEED_RULES]).delete()


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0002_harness"),
    ]

    operations = [
        migrations.RunPython(seed_policy, unseed_policy),
    ]
