"""Run directories, provenance manifests and atomic completion markers shared by every stage.

Each stage writes runs/<preset>/<stage>/: config.yaml (resolved), manifest.json (provenance), metrics.jsonl, its
outputs, and DONE.json last, atomically. A stage without DONE.json is unfinished: the next run resumes or redoes
it, and no later stage trusts it.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from typing import Callable

from omegaconf import OmegaConf

from recipe.config import config_hash, load_config
from recipe.errors import RecipeError, StageError

# Sections of the config that decide each stage's output (a change elsewhere does not invalidate it).
STAGE_KEYS = {
    "data": ["preset", "seed", "data"],
    "base": ["preset", "seed", "data", "model", "base"],
    "sft": ["preset", "seed", "data", "model", "base", "sft"],
    "rl": ["preset", "seed", "data", "model", "base", "sft", "rl"],
    "eval": ["preset", "seed", "data", "model", "base", "sft", "rl", "eval"],
}
PACKAGES = ["torch", "transformers", "trl", "accelerate", "datasets", "hydra-core", "math-verify",
            "reasoning-gym", "tokenizers", "vllm", "flash-attn"]
HASH_LIMIT = 2 << 30  # files larger than this are recorded by size only (hashing 200 GB of weights is no use)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(path: Path) -> dict:
    """sha256 of a file, or of every file below a folder (relative names), skipping temporary files."""
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
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
        self.started = None

    @property
    def done_file(self) -> Path:
        return self.dir / "DONE.json"

    def is_done(self) -> bool:
        """True when finished with this config. A finished run with another config is an error, not a redo."""
        if not self.done_file.exists():
            return False
        done = json.loads(self.done_file.read_text())
        if done.get("config_hash") == self.hash:
            return True
        if self.cfg.force:
            return False
        raise StageError(
            f"{self.name}: {self.dir} was finished with another config (hash {done.get('config_hash')}, now "
            f"{self.hash}); pass force=true to redo it, or run_root=<dir> to keep both runs")

    def begin(self, fresh: bool = False) -> None:
        """Start (or resume) the stage. fresh=True wipes a previous unfinished or forced attempt."""
        if self.done_file.exists() or fresh:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / "config.yaml", OmegaConf.to_yaml(self.cfg, resolve=True))
        self.started = time.time()

    def run(self, body: Callable[["Stage", dict], dict], requires: tuple[str, ...] = (), fresh: bool = False):
        """The life of every stage: skip it when done with this config; require its upstream stages (their
        folders are handed to body by name); begin; body(stage, upstream) returns finish()'s keyword
        arguments (inputs, outputs, extra); finish. Returns the manifest, or None when skipped."""
        if self.is_done():
            print(f"{self.name}: already done ({self.dir}); nothing to do")
            return None
        upstream = {name: require_done(self.cfg, name) for name in requires}
        self.begin(fresh=fresh)
        return self.finish(**body(self, upstream))

    def finish(self, inputs: dict, outputs: dict, extra: dict | None = None) -> dict:
        """Write the provenance manifest, then DONE.json: the last write of the stage."""
        manifest = provenance(self.cfg, self.name, self.hash, self.started, inputs, outputs, extra)
        write_atomic(self.dir / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True))
        write_atomic(self.done_file, json.dumps({"config_hash": self.hash, "ended": manifest["ended"]}))
        return manifest


def provenance(cfg, stage: str, cfg_hash: str, started: float | None, inputs: dict, outputs: dict,
               extra: dict | None = None) -> dict:
    """Who made an output, from what, with which code and packages, on which hardware, in how long."""
    end = time.time()
    started = started or end
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
        "inputs": {k: sha256_tree(v) if not isinstance(v, str) else v for k, v in inputs.items()},
        "outputs": {k: sha256_tree(v) for k, v in outputs.items()},
        **(extra or {}),
    }


def stage_dir(cfg, name: str) -> Path:
    return Path(cfg.run_root) / cfg.preset / name


def require_done(cfg, name: str) -> Path:
    d = stage_dir(cfg, name)
    if not (d / "DONE.json").exists():
        raise StageError(f"stage '{name}' has not finished ({d / 'DONE.json'} missing): run `make {name}` first")
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
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def stage_main(fn):
    """Entry-point wrapper: the recipe's errors become one clear line on stderr and exit code 2."""

    def main(argv=None):
        argv = sys.argv[1:] if argv is None else argv
        try:
            cfg = load_config(argv)
            return fn(cfg)
        except (RecipeError, FileNotFoundError) as e:
            if os.environ.get("RECIPE_DEBUG"):
                raise
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except OSError as e:  # the file system refused a path: read-only, full, a file where a folder goes
            if os.environ.get("RECIPE_DEBUG") or e.filename is None:
                raise
            print(f"error: cannot write or read {e.filename}: {e.strerror} (check run_root and its permissions)",
                  file=sys.stderr)
            sys.exit(2)

    return main
