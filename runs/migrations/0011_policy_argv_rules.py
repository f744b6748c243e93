"""The default shell rules match the parsed command (the ``words`` field, see
runs.shell_words), not the command text: quotes, paths, variables assigned
a literal and wrappers (``env``, ``timeout``, ``xargs``, ``sh -c`` …) no
longer hide a command from them. Rules that are also written as a raw
text search stay as a second net (``shell-pipe-to-shell``).

A seeded rule is changed only while it still has the pattern 0003 gave it:
an operator's edit in the admin wins. Rules are added by name when absent.
Either way the policy version moves, so approvals granted under the old
rules are void.

Each words pattern is anchored (``^``) at the command word where it can be:
a text up to EXECGO_BUDGET_MAX_COMMAND_CHARS long is searched once per
simple command, and an anchored pattern tries one start per text.
"""

import importlib

from django.db import migrations, models
from django.db.models import F

MIGRATION_0003 = importlib.import_module("runs.migrations.0003_seed_policy")
SEED_0003 = {rule[0]: rule for rule in MIGRATION_0003.SEED_RULES}

SYSTEM_DIRS = r"(?:etc|bin|sbin|usr|lib|lib32|lib64|boot|root|sys|proc|var|opt|srv)"
NOT_A_DEVICE = r"(?!(?:null|zero|full|random|urandom|stdout|stderr|stdin|tty)(?:\s|$)|fd/)"
REDIRECT = r"(?:^|\s)(?:>|>>|>\||&>|&>>|<>)\s"
CREDENTIALS = (r"(?:/etc/(?:passwd|shadow|gshadow|group|sudoers|crontab)(?![\w.])|/etc/sudoers\.d/|/etc/cron\."
               r"|/etc/pam\.d/|/etc/ld\.so\.preload|/var/spool/cron/|authorized_keys|/\.ssh/)")
INTERPRETERS = r"(?:(?:ba|da|k|z|a|mk)?sh|fish|python[0-9.]*|perl|ruby|node|nodejs|php|lua|bun|deno|sudo)"
FETCHERS = r"(?:curl|wget|fetch|aria2c|nc|ncat|netcat|socat|http|https|xh)"

# (name, tool, field, pattern, negate, outcome, priority, reason)
WORD_RULES = (
    # --- deny --------------------------------------------------------------
    ("shell-rm-rf-root", "shell", "words",
     (r"^rm\s(?:.*\s)?(?:/+(?:[^\s/]*[*?\[][^\s/]*)?/*|/+\.\.?/*|~/?\*?|\$HOME/?\*?|/" + SYSTEM_DIRS
      + r"/*\*?|/(?:home|dev|run|mnt|media)/*\*?|/\S*/\.\.(?:/\S*)?)(?:\s|$)"),
     False, "deny", 10, "deletes the root filesystem, a home or a system directory (rm of /, /*, ~, /etc …)"),
    ("shell-no-preserve-root", "shell", "words", r"(?:^|\s)--no-preserve-root(?:\s|$)", False, "deny", 11,
     "disables rm's protection of the root filesystem"),
    ("shell-sudo", "shell", "words",
     (r"^(?:sudo|su|doas|pkexec|run0|sudoedit)(?:\s|$)"
      r"|^(?:ln|cp|install)\s(?:.*\s)?\S*/(?:sudo|su|doas|pkexec)(?:\s|$)"),
     False, "deny", 13, "privilege escalation (sudo, su, doas, pkexec, or a link or copy of one)"),
    ("shell-mkfs", "shell", "words",
     r"^(?:mk(?:e2)?fs(?:\.\w+)?|mkswap|mkdosfs|wipefs|blkdiscard|sgdisk|sfdisk|fdisk|cfdisk|parted)(?:\s|$)",
     False, "deny", 14, "formats or repartitions a disk"),
    ("shell-dd-to-device", "shell", "words", r"^dd\s(?:.*\s)?of=/dev/" + NOT_A_DEVICE, False, "deny", 15,
     "writes raw data to a device"),
    ("shell-redirect-to-system-path", "shell", "words",
     (REDIRECT + r"/(?:" + SYSTEM_DIRS + r"(?:/|\s|$)|dev/" + NOT_A_DEVICE + r")"
      r"|^tee\s(?:.*\s)?/(?:" + SYSTEM_DIRS + r"(?:/|\s|$)|dev/" + NOT_A_DEVICE + r")"),
     False, "deny", 16, "writes (> or tee) to a system path outside the workspace"),
    # The system path has to be the last argument: the destination.
    ("shell-copy-to-system-path", "shell", "words",
     r"^(?:cp|mv|install|ln|rsync)\s(?:.*\s)?/" + SYSTEM_DIRS + r"(?:/\S*)?(?:\s(?:>|>>|<)\s\S+)*$",
     False, "deny", 17, "copies or moves files into a system path outside the workspace"),
    ("shell-run-downloaded-code", "shell", "words",
     (r"(?:^|\| )" + FETCHERS + r"(?: \| \S+)* \| " + INTERPRETERS + r"$"
      r"|^(?:" + INTERPRETERS + r"|eval|source|\.)\s(?:.*\s)?(?:\$\(|<\(|`)\s*(?:curl|wget)\b"),
     False, "deny", 19, "runs code downloaded from the network (curl/wget piped or substituted into an interpreter)"),
    ("shell-raw-disk-device", "shell", "words",
     r"(?:^|[\s=])/dev/(?:sd[a-z]|vd[a-z]|xvd[a-z]|hd[a-z]|nvme\d|mmcblk\d|loop\d|dm-\d|md\d|sr\d|mtd|mapper/|disk/)",
     False, "deny", 20, "reads or writes a raw disk device (cp, cat, dd, tee, > …)"),
    ("shell-find-delete-outside-workspace", "shell", "words",
     (r"^find\s+(?:-[HLPO]\S*\s+)*(?:/|~|\.\./|\.\.(?:\s|$)|\$HOME)\S*(?:\s.*)?"
      r"\s(?:-delete|-exec(?:dir)?\s+(?:\S*/)?(?:rm|shred|unlink)\s)"),
     False, "deny", 21, "deletes files it finds outside the workspace (find / … -delete, -exec rm)"),
    ("shell-setuid", "shell", "words",
     r"^chmod\s(?:.*\s)?(?:[ugoa]*[+=][rwxXt]*s\S*|[0-7]*[2467][0-7]{3})(?:\s|$)",
     False, "deny", 22, "sets the setuid/setgid bit (privilege escalation)"),
    ("shell-write-credentials", "shell", "words",
     (REDIRECT + r"\S*" + CREDENTIALS
      + r"|^(?:tee|cp|mv|install|ln|dd|truncate|chattr|rsync)\s(?:.*\s)?(?:of=)?\S*" + CREDENTIALS),
     False, "deny", 23, "writes accounts, sudoers, cron or ssh keys (/etc/passwd, /etc/shadow, authorized_keys …)"),
    ("shell-host-power", "shell", "words",
     r"^(?:shutdown|reboot|halt|poweroff|telinit)(?:\s|$)|^init\s+[06](?:\s|$)"
     r"|^systemctl\s(?:.*\s)?(?:poweroff|reboot|halt|kexec)(?:\s|$)",
     False, "deny", 24, "stops or reboots the host"),
    # --- high: a human approves ---------------------------------------------
    ("shell-package-install", "shell", "words",
     (r"^(?:apt-get|apt|aptitude|yum|dnf|zypper|brew|pip[0-9.]*|pipx|npm|pnpm|gem|cargo|go|conda|mamba|micromamba"
      r"|snap|flatpak|cpanm?|luarocks|composer|uv|nix-env|easy_install)\s(?:.*\s)?install(?:\s|$)"
      r"|^(?:yarn|pnpm|apk|poetry|uv|bun|deno)\s(?:.*\s)?add(?:\s|$)|^npm\s(?:.*\s)?(?:i|ci|add)(?:\s|$)"
      r"|^python[0-9.]*\s(?:.*\s)?-m\s?pip\s(?:.*\s)?install(?:\s|$)"
      r"|^(?:dpkg|rpm)\s(?:.*\s)?(?:-i|--install|-U|--upgrade)(?:\s|$)"
      r"|^(?:npx|uvx|bunx|pipx\s+run|(?:pnpm|yarn)\s+dlx)(?:\s|$)"),
     False, "high", 30, "installs packages (changes the host, runs third-party install scripts)"),
    ("shell-http-write", "shell", "words",
     (r"^curl\s(?:.*\s)?(?:-[a-zA-Z]*X\s?(?!(?i:GET|HEAD)(?:\s|$))\S|--request[=\s](?!(?i:GET|HEAD)(?:\s|$))"
      r"|-[a-zA-Z]*[dFT]|--(?:data\S*|form\S*|json|upload-file)(?:[=\s]|$))"
      r"|^wget\s(?:.*\s)?--(?:post-data|post-file|method|body-data|body-file)(?:[=\s]|$)"
      r"|^(?:http|https|xh|xhs)\s(?:.*\s)?(?:POST|PUT|PATCH|DELETE|-f|--form|[^\s=:@-][^\s=]*(?::=|=|@)\S*)(?:\s|$)"
      ),
     False, "high", 32, "a request that can change remote state from a shell (curl -X POST, -d, -F, wget --post-data, "
                         "http POST): approved like an http step with that method"),
    ("shell-inline-http-write", "shell", "words",
     (r"^(?:python[0-9.]*|node|nodejs|perl|ruby|php)\s.*(?:\.(?:post|put|patch|delete)\(|method\s*[=:]\s*['\"]?"
      r"(?i:POST|PUT|PATCH|DELETE)|urlopen\([^)]*data)"),
     False, "high", 41, "interpreter code that sends a state-changing request (requests.post, fetch with a method, "
                        "urlopen with data): approved like an http step with that method"),
    ("shell-git-push", "shell", "words", r"^git\s(?:.*\s)?push(?:\s|$)", False, "high", 42,
     "pushes to a remote repository (changes remote state)"),
    ("shell-raw-socket", "shell", "words", r"^(?:nc|ncat|netcat|socat|telnet)(?:\s|$)|(?:^|\s)/dev/(?:tcp|udp)/",
     False, "high", 33, "opens raw network connections (nc, ncat, socat, /dev/tcp): can send anything anywhere"),
    ("shell-mentions-credentials", "shell", "words",
     (r"^(?!(?:cat|grep|egrep|fgrep|rg|head|tail|less|more|wc|cut|sort|uniq|ls|stat|file|getent|id|diff|cmp"
      r"|md5sum|sha\d*sum|test|\[)(?:\s|$)).*" + CREDENTIALS),
     False, "high", 34, "touches accounts, sudoers, cron or ssh keys with something other than a plain reader"),
    ("shell-account-change", "shell", "words",
     r"^(?:useradd|usermod|userdel|adduser|deluser|groupadd|groupmod|passwd|chpasswd|vipw|visudo|chage)(?:\s|$)",
     False, "high", 35, "changes users, groups or passwords"),
    ("shell-schedule", "shell", "words", r"^crontab(?!\s+-l\s*$)(?:\s|$)|^(?:at|batch)(?:\s|$)", False, "high", 36,
     "installs a crontab or an at job: commands that run later, outside the run"),
    ("shell-shred", "shell", "words", r"^(?:shred|wipe|srm)(?:\s|$)", False, "high", 37,
     "overwrites files to destroy them"),
    ("shell-chown-root", "shell", "words", r"^ch(?:own|grp)\s(?:.*\s)?(?:root|0)(?:[:.]\S*)?(?:\s|$)", False, "high",
     38, "gives files to root"),
    ("shell-namespace-or-capabilities", "shell", "words",
     r"^(?:nsenter|unshare|chroot|setpriv|capsh|setcap|machinectl|systemd-run)(?:\s|$)",
     False, "high", 39, "changes namespaces, the root directory or capabilities"),
    ("shell-container-control", "shell", "words",
     r"^(?:docker|podman|nerdctl|ctr|crictl|kubectl|lxc|virsh)(?:\s|$)", False, "high", 43,
     "controls containers or machines (docker, kubectl …): a way around the step's sandbox"),
    ("shell-host-config", "shell", "words",
     r"^(?:iptables|ip6tables|nft|modprobe|insmod|rmmod|mount|umount|swapoff|swapon|sysctl|ifconfig|route)(?:\s|$)"
     r"|^ip\s(?:.*\s)?(?:link|addr|route|netns)\s(?:.*\s)?(?:add|del|set|flush)(?:\s|$)"
     r"|^systemctl\s(?:.*\s)?(?:stop|disable|mask|kill|isolate)(?:\s|$)",
     False, "high", 40, "changes the host's kernel, network, mounts or services"),
    # --- medium -------------------------------------------------------------
    ("shell-chmod-world-writable", "shell", "words",
     r"^chmod\s(?:-\S+\s+)*(?:[0-7]?[0-7]{2}[2367](?:\s|$)|[ugo]*[ao][ugo]*[+=][rwxXst]*w)",
     False, "medium", 50, "makes files world-writable (chmod 777, o+w)"),
    ("shell-chown", "shell", "words", r"^ch(?:own|grp)(?:\s|$)", False, "medium", 51, "changes file ownership"),
    ("shell-network-tool", "shell", "words",
     r"^(?:curl|wget|ssh|scp|sftp|rsync|nc|ncat|netcat|telnet|ftp|lftp|aria2c|socat|http|https|xh)(?:\s|$)",
     False, "medium", 52, "reaches the network from a shell (curl, wget, ssh, scp, …)"),
    ("shell-awk-runs-commands", "shell", "words",
     r"^(?:g|m|n)?awk\s.*(?:\bsystem\s*\(|\|\s*getline|\bprint[^|]*\|\s*[\"'])", False, "medium", 54,
     "an awk program that runs commands (system(), print | \"cmd\", \"cmd\" | getline)"),
    ("shell-find-delete", "shell", "words", r"^find\s(?:.*\s)?-delete(?:\s|$)", False, "medium", 53,
     "deletes every file a find matches"),
)


def _columns(rule) -> dict:
    _name, tool, field, pattern, negate, outcome, priority, reason = rule
    return {"tool": tool, "field": field, "pattern": pattern, "negate": negate, "outcome": outcome,
            "priority": priority, "reason": reason}


def _bump(apps) -> None:
    PolicyVersion = MIGRATION_0003.policy_model(apps, "PolicyVersion")
    PolicyVersion.objects.get_or_create(pk=1, defaults={"version": 1})
    PolicyVersion.objects.filter(pk=1).update(version=F("version") + 1)


def _move(apps, *, towards_words: bool) -> None:
    PolicyRule = MIGRATION_0003.policy_model(apps, "PolicyRule")
    changed = False
    for rule in WORD_RULES:
        name = rule[0]
        old = SEED_0003.get(name)
        source, target = (old, rule) if towards_words else (rule, old)
        row = PolicyRule.objects.filter(name=name).first()
        if row is None:
            if towards_words:
                PolicyRule.objects.create(name=name, **_columns(rule))
                changed = True
            continue
        if old is None:  # added here: removed on the way back unless an operator changed it
            if not towards_words and (row.field, row.pattern) == (rule[2], rule[3]):
                row.delete()
                changed = True
            continue
        if (row.field, row.pattern) == (source[2], source[3]):
            for column, value in _columns(target).items():
                setattr(row, column, value)
            row.save()
            changed = True
    if changed:
        _bump(apps)


def seed_word_rules(apps, schema_editor):
    _move(apps, towards_words=True)


def unseed_word_rules(apps, schema_editor):
    _move(apps, towards_words=False)


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0010_audit_hash_chain"),
    ]

    operations = [
        migrations.AlterField(
            model_name="policyrule",
            name="field",
            field=models.CharField(choices=[("argv", "Argv"), ("script", "Script"), ("command", "Command"),
                                            ("words", "Words"), ("url", "Url"), ("method", "Method"), ("path", "Path"),
                                            ("op", "Op")], max_length=10),
        ),
        migrations.AlterField(
            model_name="policyrule",
            name="pattern",
            field=models.CharField(help_text=(
                "a Python regular expression, searched in the field (for words: in each parsed simple command and "
                "each pipeline; it matches when it is found in any of them)"), max_length=500),
        ),
        migrations.RunPython(seed_word_rules, unseed_word_rules),
    ]
