"""Memory cgroups, one per sandboxed run, where this host lets us make them.

A cgroup's limit counts what RLIMIT_AS does not: the memory of all the run's processes together, shared memory
and tmpfs pages included. It is also how every process of the run is found and killed. Made under our own
cgroup: the cgroup v1 memory controller, or cgroup v2 where our cgroup delegates memory to its children (v2
forbids that while we ourselves sit in it, so on a plain v2 host without delegation there is none). The run's
processes join it through a shell that writes its own pid into cgroup.procs and then becomes the sandbox.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

JOIN = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"']  # + [cgroup.procs, command...]: it runs in the cgroup
PREFIX = "recipe-sandbox-"  # + the pid of the process that made it + a random part
_lock = threading.Lock()
_cgroup_base: tuple | None = None  # (version, folder) once probed; (0, "") where none can be made
_cgroups_left: list[str] = []  # folders whose last processes were still exiting; removed later


def _inside(mount: tuple[str, str], path: str) -> str | None:
    """The folder of cgroup `path` under a hierarchy mounted (root, at); None when the mount does not show it."""
    root, at = mount
    if root == "/":
        return at + path
    return at + path[len(root):] if path == root or path.startswith(root + "/") else None


def _remove_orphans(folder: str) -> None:
    """Empty cgroups of ours left by a process that was killed before it could remove them (named by its pid)."""
    for entry in os.scandir(folder):
        owner = entry.name[len(PREFIX):].split("-")[0]
        if entry.name.startswith(PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            try:
                os.rmdir(entry.path)  # fails, harmlessly, on one that still holds a process
            except OSError:
                pass


def _find_cgroup_base() -> tuple[int, str]:
    """Our own memory cgroup, if child cgroups with a memory limit can be made under it."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return 0, ""
    v1 = v2 = None  # (root, mount point) of the v1 memory hierarchy and of the v2 one
    for ln in mountinfo:
        fields, _, rest = ln.partition(" - ")
        fields, rest = fields.split(), rest.split()
        if len(fields) >= 5 and len(rest) >= 3:
            if rest[0] == "cgroup" and "memory" in rest[2].split(","):
                v1 = (fields[3], fields[4])
            elif rest[0] == "cgroup2":
                v2 = (fields[3], fields[4])
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and v1:
            folder, version = _inside(v1, path), 1
        elif hier == "0" and v2:
            folder, version = _inside(v2, path), 2
            try:
                if not folder or "memory" not in Path(folder, "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        else:
            continue
        if not folder:
            continue
        probe = Path(folder, f"recipe-sandbox-probe-{os.getpid()}")
        try:
            probe.mkdir()
            try:
                (probe / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(64 << 20))
                joined = subprocess.run(JOIN + [str(probe / "cgroup.procs"), "true"], timeout=10).returncode == 0
            finally:
                probe.rmdir()
            if joined:
                _remove_orphans(folder)
                return version, folder
        except (OSError, subprocess.SubprocessError):
            continue
    return 0, ""


class Cgroup:
    """A memory cgroup of one run: its limit, its processes (to kill them all) and whether it ran out."""

    @staticmethod
    def make(limit_bytes: int) -> Cgroup | None:
        """A new cgroup under ours holding at most limit_bytes, or None where none can be made."""
        global _cgroup_base
        with _lock:
            if _cgroup_base is None:
                _cgroup_base = _find_cgroup_base()
                atexit.register(_remove_left_cgroups)
            version, base = _cgroup_base
        _remove_left_cgroups()
        if not version:
            return None
        path = os.path.join(base, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
        except OSError:
            return None
        cg = Cgroup(version, path)
        limits = ([("memory.limit_in_bytes", limit_bytes), ("memory.memsw.limit_in_bytes", limit_bytes)]
                  if version == 1 else [("memory.max", limit_bytes), ("memory.swap.max", 0)])
        for name, value in limits:
            try:
                cg._write(name, str(value))
            except OSError:
                if name in ("memory.limit_in_bytes", "memory.max"):
                    cg.remove()
                    return None  # no limit, no point
        return cg

    def __init__(self, version: int, path: str):
        self.version, self.path = version, path
        self.procs = os.path.join(path, "cgroup.procs")

    def join(self) -> list[str]:
        """The start of a command that runs in this cgroup: a shell joins it (as root, before anything else runs)
        and then becomes the command, so no process of the run ever starts outside it."""
        return JOIN + [self.procs]

    def _write(self, name: str, text: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(text)

    def pids(self) -> list[int]:
        try:
            with open(self.procs) as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self) -> None:
        if self.version == 2 and os.path.exists(os.path.join(self.path, "cgroup.kill")):
            try:
                self._write("cgroup.kill", "1")
                return
            except OSError:
                pass
        for _ in range(5):  # a process may fork while we read the list: go again until it is empty
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        """rmdir once the last process has gone (a killed pid namespace takes the kernel a moment)."""
        for _ in range(20):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                self.kill_all()
                time.sleep(0.005)
        with _lock:
            _cgroups_left.append(self.path)


def _remove_left_cgroups() -> None:
    with _lock:
        left = list(_cgroups_left)
        _cgroups_left.clear()
    for path in left:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            with _lock:
                _cgroups_left.append(path)
