"""Run inside a step (by /usr/bin/python3): each probe makes one system call
that the filter refuses, with arguments that make it harmless whether or
not the filter is there, and prints {probe: errno} as JSON (0: it
succeeded). Never imported by the tests themselves: its text is the step's
program."""

import ctypes
import json
import mmap
import os
import signal
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
WORKSPACE = os.getcwd()
MISSING = os.path.join(WORKSPACE, "no-such-dir").encode()
CLONE_NEWUSER = 0x10000000
CLONE_THREAD = 0x00010000
NS_FLAGS = {"newns": 0x00020000, "newcgroup": 0x02000000, "newuts": 0x04000000, "newipc": 0x08000000,
            "newuser": 0x10000000, "newpid": 0x20000000, "newnet": 0x40000000}
X32 = 0x40000000


def call(number, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return 0 if result >= 0 else ctypes.get_errno()


def in_child(probe):
    """probe() in a forked child -> its errno (or -signal if it was killed)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(probe())
        except BaseException:
            os._exit(255)
    status = os.waitpid(pid, 0)[1]
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)


def ptrace_sibling():
    """A child ptraces its sleeping sibling (PTRACE_ATTACH); both are killed after."""
    sleeper = os.fork()
    if sleeper == 0:
        time.sleep(30)
        os._exit(0)
    try:
        return in_child(lambda: call(101, 16, sleeper, 0, 0))
    finally:
        os.kill(sleeper, signal.SIGKILL)
        os.waitpid(sleeper, 0)


def process_vm_readv_sibling():
    sleeper = os.fork()
    if sleeper == 0:
        time.sleep(30)
        os._exit(0)
    try:
        return call(310, sleeper, None, 0, None, 0, 0)
    finally:
        os.kill(sleeper, signal.SIGKILL)
        os.waitpid(sleeper, 0)


def i386_unshare():
    """unshare(CLONE_NEWUSER) through the i386 table (int 0x80), in a child:
    a filter without that ABI would kill it."""
    code = bytes([0x53, 0xB8]) + (310).to_bytes(4, "little") + bytes([0xBB]) + CLONE_NEWUSER.to_bytes(4, "little") \
        + bytes([0xCD, 0x80, 0x5B, 0xC3])  # push rbx; mov eax, 310; mov ebx, flags; int 0x80; pop rbx; ret
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    return in_child(lambda: -function() if function() < 0 else 0)


PROBES = {
    # mounts and the root
    "mount_missing_dir": lambda: call(165, b"none", MISSING, b"tmpfs", 0, None),
    "mount_workspace_dir": lambda: call(165, b"none", os.path.join(WORKSPACE, "mnt").encode(), b"tmpfs", 0, None),
    "umount2_bad_flags": lambda: call(166, b"/", 0xFFFF),
    "chroot_missing_dir": lambda: call(161, MISSING),
    "pivot_root_missing": lambda: call(155, MISSING, MISSING),
    "fsopen_bad_flags": lambda: call(430, b"tmpfs", 0xFFFF),
    "open_tree_bad_flags": lambda: call(428, -1, b"/", 0xFFFFFFFF),
    # namespaces
    "unshare_user": lambda: in_child(lambda: call(272, CLONE_NEWUSER)),
    "setns_bad_fd": lambda: call(308, -1, 0),
    **{f"clone_{name}": (lambda f=flag: call(56, f | CLONE_THREAD, 0, 0, 0, 0)) for name, flag in NS_FLAGS.items()},
    "clone3_null": lambda: call(435, None, 0),
    # the kernel
    "bpf_oversized": lambda: call(321, 0, None, 1 << 20),
    "perf_event_open_null": lambda: call(298, None, 0, -1, -1, 0),
    "userfaultfd_bad_flags": lambda: call(323, 1 | 0x4000),
    "io_uring_setup_null": lambda: call(425, 0, None),
    "lookup_dcookie": lambda: call(212, 0, None, 0),
    "sysfs_bad_option": lambda: call(139, 9999),
    "init_module_null": lambda: call(175, None, 0, None),
    "delete_module_missing": lambda: call(176, b"execgo-no-such-module", 0),
    "kexec_load_none": lambda: call(246, 0, 0, None, 0xFFFFFFFF),
    "reboot_bad_magic": lambda: call(169, 0, 0, 0, None),
    "swapon_missing": lambda: call(167, MISSING, 0),
    "acct_missing": lambda: call(163, MISSING),
    "syslog_bad_type": lambda: call(103, 9999, None, 0),
    # keyrings
    "keyctl_bad_op": lambda: call(250, 9999, 0, 0, 0, 0),
    "add_key_null": lambda: call(248, None, None, None, 0, 0),
    "request_key_null": lambda: call(249, None, None, None, 0),
    # other processes
    "ptrace_sibling": ptrace_sibling,
    "process_vm_readv_sibling": process_vm_readv_sibling,
    "kcmp_bad_type": lambda: call(312, os.getpid(), os.getpid(), 99, 0, 0),
    "name_to_handle_at_missing": lambda: call(303, -100, MISSING, None, None, 0),
    # the clock (settimeofday(NULL, NULL) changes nothing)
    "settimeofday_null": lambda: call(164, None, None),
    "clock_settime_bad_clock": lambda: call(227, 9999, None),
    "clock_adjtime_bad_clock": lambda: call(305, 9999, None),
    "adjtimex_null": lambda: call(159, None),
    # hardware
    "iopl_bad_level": lambda: call(172, 4),
    "ioperm_empty": lambda: call(173, 0, 0, 1),
    # personality: no ASLR off (run in a child, which exits at once)
    "personality_no_aslr": lambda: in_child(lambda: call(135, 0x0040000)),
    "personality_query": lambda: call(135, 0xFFFFFFFF),
    "personality_default": lambda: call(135, 0),
    # the other ABIs
    "x32_unshare_user": lambda: in_child(lambda: call(X32 | 272, CLONE_NEWUSER)),
    "i386_unshare_user": i386_unshare,
}

if __name__ == "__main__":
    os.makedirs(os.path.join(WORKSPACE, "mnt"), exist_ok=True)
    names = sys.argv[1:] or list(PROBES)
    print(json.dumps({name: PROBES[name]() for name in names}))
