"""The host's side of the unisolated rlimit backend: the run's folder, and the end of its processes and files.

Everything here acts by file descriptors and names relative to them, never by a path a sandboxed process could
have changed: a program may swap any name in its folder for a link while it runs, or leave a process behind
that does so during clean-up. As root the run has a private uid, which makes "every process of the run" and
"every file of the run" exact: kill(-1) as that uid, and entries owned by it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile

SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable: where an unisolated run may leave files
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _empty(dir_fd: int, as_root: bool) -> None:
    """Remove what the folder open as dir_fd holds, by names relative to it, never following a link: a program
    may have swapped any name for a link while it ran. Only without root are permissions put back, and only on
    an entry of this folder that is not a link (fchmodat, not following): root needs none."""
    for entry in os.scandir(dir_fd):
        _remove_entry(entry, dir_fd, as_root)


def _remove_entry(entry: os.DirEntry, dir_fd: int, as_root: bool) -> None:
    """Remove one entry of the folder open as dir_fd (a folder with what it holds), never following a link."""
    try:
        if entry.is_dir(follow_symlinks=False):
            if not as_root:
                os.chmod(entry.name, 0o700, dir_fd=dir_fd, follow_symlinks=False)
            fd = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                _empty(fd, as_root)
            finally:
                os.close(fd)
            os.rmdir(entry.name, dir_fd=dir_fd)
        else:
            os.unlink(entry.name, dir_fd=dir_fd)
    except OSError:
        pass

class Workdir:
    """The rlimit backend's cwd: <tmp>/recipe-sandbox-*/ (the host's, 0711) holding home/ (the run's uid's, 0700).
    The run's uid cannot rename either, so removal by the folders' own descriptors removes just them."""

    def __init__(self, uid: int | None):
        self.as_root = uid is not None
        tmp = tempfile.gettempdir()
        path = tempfile.mkdtemp(prefix="recipe-sandbox-", dir=tmp)
        self.name = os.path.basename(path)
        self.parent = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.fd = os.open(self.name, _DIR_FLAGS, dir_fd=self.parent)
        os.fchmod(self.fd, 0o711)
        os.mkdir("home", 0o700, dir_fd=self.fd)
        self.home_fd = os.open("home", _DIR_FLAGS, dir_fd=self.fd)
        if uid is not None:
            os.fchown(self.home_fd, uid, uid)
        self.home = os.path.join(path, "home")

    def remove(self) -> None:
        if not self.as_root:
            os.fchmod(self.home_fd, 0o700)
        _empty(self.home_fd, self.as_root)
        for name, fd, parent in (("home", self.home_fd, self.fd), (self.name, self.fd, self.parent)):
            os.close(fd)
            try:
                os.rmdir(name, dir_fd=parent)  # an rmdir removes nothing but an empty folder, whatever is there
            except OSError:
                pass
        os.close(self.parent)


def kill_uid(uid: int, exe: str) -> None:
    """rlimit backend as root: kill(-1) as the run's private uid ends every process of that uid at once."""
    try:
        subprocess.run([exe, "-S", "-c", "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass"],
                       user=uid, group=uid, extra_groups=[], env={}, cwd="/", timeout=10,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        pass


def remove_files_of(uid: int) -> None:
    """rlimit backend as root: what the run's uid left in the world-writable folders (not following links)."""
    for folder in {tempfile.gettempdir(), *SHARED_TMP}:
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            for entry in os.scandir(fd):
                try:
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        _remove_entry(entry, fd, as_root=True)
                except OSError:
                    pass
        finally:
            os.close(fd)


def kill_escaped(token: str, sid: int, uid: int) -> None:
    """rlimit backend without root: kill the run's processes that left its process group (setpgid, setsid): same
    session, or still the run's token in their environment. A process that does both escapes this."""
    needle = f"RECIPE_SANDBOX_RUN={token}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                found = needle in f.read()
            if not found:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    found = int(f.read().rsplit(b")", 1)[1].split()[3]) == sid  # field 6: session id
            if found:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
