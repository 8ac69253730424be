"""What tests/test_distributed.py runs on every rank under torchrun (and, for the one-process references, in the
test itself). Two modes:

    dist_ranks.py steps <folder>        train steps, published weights and checkpoints of the trainer (ranks)
    dist_ranks.py rl <overrides...>     `python -m recipe.rl` with the math reward faked (see text_reward)
"""
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

from recipe.config import RLConfig  # noqa: E402
from recipe.envs.base import RewardResult  # noqa: E402
from recipe.envs.math import MathEnv  # noqa: E402
from recipe.model import load_pretrained  # noqa: E402
from recipe.rl.dist import World, close_world, init_world, load_sharded, split_by_tokens  # noqa: E402
from recipe.rl.orchestrator import Sample  # noqa: E402
from recipe.rl.trainer import (build_optimizer, scheduler_for, full_state_dict, load_checkpoint,  # noqa: E402
                               publish_weights, save_checkpoint, train_step)

# warmup 2: the learning rate differs between the first two steps, so a resume must restore the schedulers too;
# micro-batches of 2 and one long sample: the token-balanced shares hold 4 and 6 samples, so one rank makes an
# idle pass while the other makes its third
# share_prompts off: ranks run every sample whole, and the one-process reference takes the same path (the shared
# one rounds differently; tests/test_trainer.py compares the two)
RL_CFG = dict(lr=1e-3, warmup_steps=2, micro_batch_size=2, max_grad_norm=1.0, share_prompts=False)


def batches(vocab: int) -> list[list[Sample]]:
    """Two batches of samples of varied lengths, advantages, masks and logprobs (some outside the ratio band)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(2):
        batch = []
        for i, n in enumerate([30, 3, 5, 2, 9, 4, 3, 6, 2, 7]):
            comp = torch.randint(3, vocab, (n,), generator=g).tolist()
            lp = (-math.log(vocab) + 0.3 * torch.randn(n, generator=g)).tolist()
            if i % 4 == 1:
                lp[0] -= 3.0  # ratio about e^3: masked as too high
            mask = [0 if (i == 4 and 3 <= t < 6) else 1 for t in range(n)]  # a tool reply inside sample 4
            advantage = 0.0 if (b, i) == (0, 3) else (1.0 if (i + b) % 3 else -0.5) - 0.1 * i  # 0: skipped, counted
            batch.append(Sample([5, 6 + b, 7 + i % 3], comp, lp, mask, advantage, 0.0, 0, "math"))
        out.append(batch)
    return out


def trainer(start: Path, optimizer: str, world: World, replicas: int = 1):
    model, tok = load_sharded(start, world, replicas, "float32", "sdpa")
    cfg = RLConfig(optimizer=optimizer, **RL_CFG)
    opt = build_optimizer(model, cfg)
    return model, opt, scheduler_for(opt, cfg), cfg, tok


def step(model, opt, sch, cfg, batch, world: World, pad_id: int) -> dict:
    share = world.scatter(split_by_tokens(batch, world.size) if world.main else None)
    return train_step(model, opt, sch, torch.device("cpu"), share, cfg, pad_id, world)


def fixed_gradient_steps(model, opt) -> None:
    """Two optimizer steps (the second on top of the first's momentum) on gradients drawn from seeds: the same
    whole tensors in every run, each rank given its shard of them. The optimizer alone, with no backward whose
    rounding differs between 1 and 2 ranks."""
    for s in range(2):
        for i, (_, p) in enumerate(model.named_parameters()):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * s + i), dtype=p.dtype)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) \
                if isinstance(p, DTensor) else g
        opt.step()
        opt.zero_grad()


def steps_mode(folder: Path) -> None:
    """Rank r of 2: writes under <folder>/ranks what the test compares with its one-process run."""
    torch.set_num_threads(1)
    world = init_world(120)
    out = folder / "ranks"
    start = folder / "start"
    import recipe.rl.dist as rl_dist

    loads = []  # whether each load_pretrained call of this rank read the weights

    def recorded(*args, weights=True, **kwargs):
        loads.append(weights)
        return load_pretrained(*args, weights=weights, **kwargs)

    rl_dist.load_pretrained = recorded
    try:
        model, opt, sch, cfg, tok = trainer(start, "adamw", world)
        (out / f"loads_rank{world.rank}.json").parent.mkdir(parents=True, exist_ok=True)
        (out / f"loads_rank{world.rank}.json").write_text(json.dumps(loads))
        a, b = batches(len(tok))
        stats = step(model, opt, sch, cfg, a, world, tok.pad_token_id)
        publish_weights(model, out / "weights", 1, world=world)
        save_checkpoint(out / "checkpoints", 1, model, opt, sch, {"from": "ranks"}, keep=2, world=world)
        step(model, opt, sch, cfg, b, world, tok.pad_token_id)
        after_b = full_state_dict(model, world)
        # 1 -> 2: the one-process checkpoint the test wrote before starting the ranks, then the same next step
        model, opt, sch, cfg, _ = trainer(start, "adamw", world)
        at, _ = load_checkpoint(folder / "single" / "checkpoints" / "step_000001", model, opt, sch, world)
        step(model, opt, sch, cfg, b, world, tok.pad_token_id)
        resumed = full_state_dict(model, world)
        model, opt, sch, cfg, _ = trainer(start, "muon", world)
        step(model, opt, sch, cfg, a, world, tok.pad_token_id)
        muon = full_state_dict(model, world)
        model, opt, sch, cfg, _ = trainer(start, "muon", world)
        fixed_gradient_steps(model, opt)
        muon_fixed = full_state_dict(model, world)
        model, opt, sch, cfg, _ = trainer(start, "muon", world, replicas=2)  # a 2-D mesh: (replicate, shard)
        fixed_gradient_steps(model, opt)
        muon_fixed_hsdp = full_state_dict(model, world)
        # HSDP: 2 replicas of 1 shard each (prime-rl's 2-way replication, at the smallest size)
        model, opt, sch, cfg, _ = trainer(start, "adamw", world, replicas=2)
        step(model, opt, sch, cfg, a, world, tok.pad_token_id)
        hsdp = full_state_dict(model, world)
        if world.main:
            (out / "stats.json").write_text(json.dumps(stats))
            torch.save({"after_b": after_b, "resumed_from_single": resumed, "resumed_step": at, "muon": muon,
                        "muon_fixed": muon_fixed, "muon_fixed_hsdp": muon_fixed_hsdp, "hsdp": hsdp},
                       out / "states.pt")
    finally:
        close_world(world)


def text_reward(self, text, row):
    """A random model never answers right: reward a property of the sampled text, so that groups have signal."""
    return RewardResult(float(sum(map(ord, text)) % 2))


def rl_mode(argv: list[str]) -> None:
    import runpy

    MathEnv.score = text_reward
    sys.argv = ["recipe.rl", *argv]
    runpy.run_module("recipe.rl", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1] == "steps":
        steps_mode(Path(sys.argv[2]))
    else:
        rl_mode(sys.argv[2:])
