"""The seccomp filter every sandboxed program runs under: classic BPF, built here, no library needed.

It denies, with EPERM (so Python raises an ordinary OSError instead of dying), system calls a test program never
needs and that would let it escape or disturb other runs: tracing and reading other processes, namespaces and
mounts, kernel modules and keyrings, the clock, memfd (memory that RLIMIT_AS does not count), CPU affinity (a
program must not widen the cores it was given), io_uring and bpf, SysV shared memory, semaphores and message
queues and POSIX message queues (IPC that outlives its process: in a warm sandbox it would reach the next run),
and sockets other than AF_UNIX (no network, whatever the backend). clone3 answers ENOSYS so that libc falls back
to clone, whose flags the filter can see: clone with a namespace flag is denied like unshare. A system call of
another ABI (i386 or x32 on x86_64) is denied outright: its numbers differ from those listed here.

filter_bytes() is the program as struct sock_filter records: what `bwrap --seccomp FD` reads, and what the
other backends install with prctl(PR_SET_SECCOMP) just before the program starts.
"""
from __future__ import annotations

import errno
import os
import struct

# (x86_64, aarch64) numbers; None where the architecture has no such call
DENIED = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "process_madvise": (440, 440),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "acct": (163, 89), "syslog": (103, 116), "quotactl": (179, 60),
    "lookup_dcookie": (212, 18), "vhangup": (153, 58), "iopl": (172, None), "ioperm": (173, None),
    "uselib": (134, None), "_sysctl": (156, None), "personality": (135, 92),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265), "fanotify_init": (300, 262),
    "unshare": (272, 97), "setns": (308, 268),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "shmget": (29, 194),
    "semget": (64, 190), "msgget": (68, 186), "mq_open": (240, 180),
    "sched_setaffinity": (203, 122),
}
SOCKET, CLONE, CLONE3 = {"x86_64": 41, "aarch64": 198}, {"x86_64": 56, "aarch64": 220}, 435
ARCH = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column in DENIED, AUDIT_ARCH_*
X32_BIT = 0x40000000
AF_UNIX = 1
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # the unshare backend calls it while it builds the root

# classic BPF opcodes and the offsets of struct seccomp_data (nr, arch, ip, args[6]; little-endian args)
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
NR, ARCH_OFF, ARG0 = 0, 4, 16
ALLOW, ERRNO = 0x7FFF0000, 0x00050000


def machine() -> str:
    return os.uname().machine


def _program(arch: str) -> list[tuple]:
    """Instructions (code, jump-if-true, jump-if-false, k); jumps name labels, resolved by filter_bytes."""
    col, audit = ARCH[arch]
    prog = [(LD_ABS, 0, 0, ARCH_OFF), (JEQ, 0, "deny", audit), (LD_ABS, 0, 0, NR)]
    if arch == "x86_64":
        prog.append((JGE, "deny", 0, X32_BIT))
    prog += [(JEQ, "deny", 0, nrs[col]) for nrs in DENIED.values() if nrs[col] is not None]
    prog += [(JEQ, "enosys", 0, CLONE3), (JEQ, "socket", 0, SOCKET[arch]), (JEQ, "clone", 0, CLONE[arch]),
             (RET, 0, 0, ALLOW),
             "socket", (LD_ABS, 0, 0, ARG0), (JEQ, "allow", "deny", AF_UNIX),
             "clone", (LD_ABS, 0, 0, ARG0), (JSET, "deny", "allow", CLONE_NAMESPACES),
             "allow", (RET, 0, 0, ALLOW),
             "deny", (RET, 0, 0, ERRNO | errno.EPERM),
             "enosys", (RET, 0, 0, ERRNO | errno.ENOSYS)]
    return prog


def filter_bytes(arch: str | None = None) -> bytes | None:
    """The filter as struct sock_filter records, or None on an architecture this module has no table for."""
    arch = arch or machine()
    if arch not in ARCH:
        return None
    prog = _program(arch)
    labels, code = {}, []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(code)
        else:
            code.append(item)

    def offset(target, at: int) -> int:
        jump = target if isinstance(target, int) else labels[target] - at - 1
        assert 0 <= jump < 256, "a classic BPF jump reaches at most 255 instructions ahead"
        return jump

    return b"".join(struct.pack("=HBBI", op, offset(jt, i), offset(jf, i), k)
                    for i, (op, jt, jf, k) in enumerate(code))
