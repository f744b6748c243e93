"""The shim's host self-test, run as ``python -I -S runtime/shim.py --probe``
by the capability probe (runtime/capabilities.py): can this interpreter fork
a child that is PID 1 of its own PID namespace, does RLIMIT_FSIZE stop a
write, can a child get the process profile's mount and network namespaces?
Prints its report as JSON.

Imported only for ``--probe``, never on a step's path; like the rest of the
shim it imports only C modules.
"""

import _signal
import errno
import os
import resource
import sys

if __package__:
    from . import shim_isolation as iso
    from . import shim_process as proc
else:  # the shim's bare interpreter, run with --probe
    import shim_isolation as iso
    import shim_process as proc

SIG = _signal


def _probe_namespaces():
    """Can a child of ours get a mount and a network namespace, a tmpfs and
    a loopback in them (what the process profile's ``isolate`` does)?"""
    report = {}
    for name, flags in (("mount", iso.CLONE_NEWNS), ("net", iso.CLONE_NEWNET)):
        pid = os.fork()
        if pid == 0:
            try:
                proc.libc_call("unshare", flags)
                if flags == iso.CLONE_NEWNS:
                    proc.mount(None, "/", None, iso.MS_REC | iso.MS_PRIVATE, None)
                    iso.harden_mounts()
                    proc.mount("tmpfs", "/tmp", "tmpfs", iso.MS_NOSUID | iso.MS_NODEV, "size=65536,mode=0700")
                else:
                    iso.loopback_up()
                os._exit(0)
            except BaseException:
                os._exit(7)
        report[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return report


def probe():
    """Check, in this interpreter, the mechanisms the shim relies on; print JSON."""
    report = {"euid": os.geteuid()}
    try:
        proc.load_libc()
        report["libc"] = True
    except OSError as exc:
        report["libc"] = False
        report["libc_error"] = str(exc)
    code, error = -1, None
    if report["libc"]:  # can we fork a child that is PID 1 of its own namespace, twice?
        own = os.open("/proc/self/ns/pid", os.O_RDONLY)
        try:
            for _attempt in range(2):
                pid, isolated = proc.fork_into_new_pid_namespace(own)
                if pid == 0:
                    os._exit(0 if os.getpid() == 1 else 3)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                if not isolated:
                    error, code = "unshare(CLONE_NEWPID) refused (needs CAP_SYS_ADMIN)", -1
                    break
        except OSError as exc:
            error = str(exc)
        finally:
            os.close(own)
    report["pid_namespace"] = {"available": code == 0, "exit_code": code, "error": error}
    pid = os.fork()
    if pid == 0:  # does RLIMIT_FSIZE stop a write?
        try:
            fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
            _signal.signal(SIG.SIGXFSZ, _signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))
            try:
                written = os.write(fd, b"xx")
            except OSError as exc:
                os._exit(0 if exc.errno == errno.EFBIG else 4)
            os._exit(0 if written == 1 else 5)
        except BaseException:
            os._exit(6)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    report["rlimits"] = {"enforced": code == 0, "exit_code": code}
    report["namespaces"] = _probe_namespaces() if report["libc"] else {"mount": False, "net": False}
    sys.stdout.write(proc.dumps(report) + "\n")
    return 0
