"""The per-role commands, shared by every scale: the trainer ranks (torchrun), one command a role.

On this machine `make rl` / `make sft` with launcher.num_processes=N > 1 re-runs the stage under
`torchrun --standalone`; the SLURM script (recipe.launch, rl.sbatch.j2) starts the same module under torchrun on
each trainer node with the node's rank and the first trainer node as the rendezvous. docs/architecture.md
("Ranks") has the roles.
"""
from __future__ import annotations

import os
import sys

from recipe.runs import Stage, require_done


def launched() -> bool:
    """Whether a launcher (torchrun, accelerate launch) started this process as one rank of several."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_command(module: str, num_processes: int, argv: list[str], python: str | None = None) -> list[str]:
    """The command that starts `num_processes` ranks of `module` on this machine with the same overrides."""
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={num_processes}", "-m", module, *argv]


def relaunch(cfg, stage_name: str, requires: tuple[str, ...], module: str, argv: list[str], threads: int) -> None:
    """Replace this process with torchrun (same pid: a signal to it reaches the agent, which passes it on to every
    rank). The stage's refusals (a held folder, a missing upstream stage) and a finished stage are answered here
    first, with their usual line and exit code; rank 0 checks them again under the lock it then holds."""
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
    os.execve(sys.executable, cmd, env)
