"""The per-role commands, shared by every scale: the trainer ranks (torchrun), one command a role.

On this machine `make rl` / `make sft` with launcher.num_processes=N > 1 runs the stage under
`torchrun --standalone` (relaunch); the SLURM script (recipe.launch, rl.sbatch.j2) starts the same module under
torchrun on each trainer node with the node's rank and the first trainer node as the rendezvous. docs/architecture.md
("Ranks") has the roles.
"""
from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys

from recipe.runs import Stage, require_done

# the policy servers' base URLs, comma-separated, that a SLURM job started for its orchestrator (recipe.rl.loop)
INFERENCE_URLS_ENV = "RECIPE_INFERENCE_URLS"


def torchrun_command(module: str, num_processes: int, argv: list[str], python: str | None = None) -> list[str]:
    """The command that starts `num_processes` ranks of `module` on this machine with the same overrides."""
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={num_processes}", "-m", module, *argv]


def die_with_parent(sig: int):
    """Linux: a function for a child to call before exec, so that the kernel sends it `sig` when this process dies,
    even by kill -9 (PR_SET_PDEATHSIG); None where prctl is missing. libc is resolved here, in the parent."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, sig)


def relaunch(cfg, stage_name: str, requires: tuple[str, ...], module: str, argv: list[str], threads: int) -> None:
    """Run the stage under torchrun, as a child of this process, and exit with its outcome. The stage's refusals
    (a held folder, a missing upstream stage) and a finished stage are answered here first, with their usual line
    and exit code; rank 0 checks them again under the lock it then holds.

    SIGTERM or SIGINT here is passed on to torchrun, whose agent passes it on to every rank: they checkpoint and
    stop, and this process then exits 128 + the signal (143 for SIGTERM), as a one-process stage does (torchrun's
    own code for it is 1). If this process is killed outright, the kernel sends torchrun SIGTERM."""
    stage = Stage(cfg, stage_name)
    with stage.locked():
        if stage.is_done():
            print(f"{stage_name}: already done ({stage.dir}); nothing to do")
            return
        for name in requires:
            require_done(cfg, name, by=stage_name)
    cmd = torchrun_command(module, cfg.launcher.num_processes, argv)
    # torchrun would set it to 1 with a banner; the ranks set their torch threads from the stage's config anyway
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    sys.stdout.flush()
    sys.stderr.flush()
    signals: list[int] = []
    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent(signal.SIGTERM))

    def forward(signum, frame):
        signals.append(signum)
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals:
        sys.exit(128 + signals[0])
    if rc:
        sys.exit(rc if rc > 0 else 128 - rc)


def torchrun_on_nodes(module: str, nodes: int, ranks_per_node: int, master_port: int, argv: list[str],
                      python: str = "python") -> str:
    """The shell command each trainer node of a SLURM job runs (one task a node): torchrun with this node's rank
    ($SLURM_PROCID, the task's index in the step) and the first trainer node ($MASTER_ADDR) as the rendezvous.
    The same module and overrides as torchrun_command; only the placement differs."""
    q = shlex.quote
    return " ".join([
        "exec", q(python), "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={ranks_per_node}",
        '--node-rank="$SLURM_PROCID"', '--master-addr="$MASTER_ADDR"', f"--master-port={master_port}",
        "-m", module, *map(q, argv)])
