"""A GPU check of the recipe's own training and generation code: tokens/s, MFU and peak memory, in one command.

    python -m recipe.gpu_check [--device cuda|cpu] [--size mid|large|tiny] [--trainer fsdp|autocast]
                               [--compile] [--profile] [--sft-steps N] [--rl-steps N] [--peak-tflops F] [--out PATH]

On one device it builds a GLM-4-MoE (Glm4MoeForCausalLM, through recipe.model.build_tiny_model; no hub) and trains
it as the production ranks do (--trainer fsdp, the default: FSDP2 mixed precision, float32 master weights gathered
in bf16, on a process group of this one rank, so that train_step, publish_weights and the optimizer take the ranks'
path) or as one process does (--trainer autocast: float32 parameters under torch.autocast). It runs:

1. SFT: a few optimizer steps of next-token loss on random token batches. A plain torch loop (AdamW): TRL, which
   the recipe's SFT stage runs on, is not on the GPU machine, and the step's cost is the model's forward and
   backward either way.
2. RL, every step as recipe.rl.loop does it: the recipe's hf engine (recipe.inference.hf.HFEngine, its
   KV-cached decode loop) generates a batch of rollouts on the device; the recipe's train_step
   (recipe.rl.trainer, the masked importance-sampling loss of recipe.rl.loss) takes one optimizer step on them
   with the recipe's optimizer (build_optimizer: Muon on the weight matrices + AdamW), with the RL settings of
   preset=intellect3 (temperature 1.05, Muon, its masking band); the new weights are published with
   publish_weights (recipe.weights: safetensors on disk) and read back into the engine with update_weights.

It prints a table and writes every number to a JSON file ($OUT/gpu_check.json when OUT is set, else
./gpu_check.json). scripts/gpu_check.sh runs it on the GPU machine.

MFU = 6 * N_active * tokens / seconds / peak (training), 2 * N_active * tokens / seconds / peak (generation).
N_active counts every parameter a token's forward pass multiplies by: attention, the dense layer's MLP, the
shared expert, the router, k/E of the routed experts' weights (top-k of E), norms and the output head; the
input embedding (a lookup) is left out. Attention's score FLOPs, which grow with the sequence, are not counted;
mfu_with_attention adds them (QK^T and AV over the causal query-key pairs, attention_flops).
The peak defaults to 989 TFLOP/s, the H100/H200 SXM datasheet's dense bf16 rate; --peak-tflops overrides it.
On CUDA the JSON also holds the rate of one large bf16 matrix product measured there, for comparison.

Sizes. mid: about 0.9B parameters, 0.2B active a token (hidden 1024, 16 layers with the first dense, 32 routed
experts top-4 + 1 shared, vocab 32768): the whole check ran in 67 s on one H200 (34 GiB at the peak); eager,
its steps wait on the host launching kernels more than on the matrix products (docs/performance.md). large:
hidden 1536 and 128-dim heads, about 2.0B parameters, 0.44B active. tiny: the tiny preset's sizes, for a CPU run of
the same code path (tests/test_gpu_check.py). scripts/gpu_sweep.sh runs the check with its variants (--compile,
--size large, more rows a step, --profile); RESULTS.md tables the H200 runs (results/gpu/).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


H200_PEAK_BF16_TFLOPS = 989.0  # dense bf16, H100/H200 SXM datasheet (989.4); no sparsity

SIZES = {
    "mid": {
        "arch": dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=64, moe_intermediate_size=512,
                     n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
                     partial_rotary_factor=0.5, rope_theta=1_000_000.0, attention_bias=True,
                     max_position_embeddings=4096),
        "sft_batch": 8, "sft_seq": 2048, "prompts": 16, "rollouts": 4, "prompt_len": 128, "max_new_tokens": 256,
        "micro_batch": 16, "gen_batch": 64,
    },
    # wider matrices (hidden 1536, 128-dim heads as GLM-4.5's): about 2.0B parameters, 0.44B active a token
    "large": {
        "arch": dict(vocab_size=32768, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                     num_attention_heads=12, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                     n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
                     partial_rotary_factor=0.5, rope_theta=1_000_000.0, attention_bias=True,
                     max_position_embeddings=4096),
        "sft_batch": 8, "sft_seq": 2048, "prompts": 16, "rollouts": 4, "prompt_len": 128, "max_new_tokens": 256,
        "micro_batch": 16, "gen_batch": 64,
    },
    "tiny": {
        "arch": dict(),  # recipe.config.TinyArch's defaults: the tiny preset's model
        "sft_batch": 4, "sft_seq": 64, "prompts": 4, "rollouts": 2, "prompt_len": 16, "max_new_tokens": 16,
        "micro_batch": 8, "gen_batch": 64,
    },
}
TRAINERS = ("fsdp", "autocast")
EXPERTS = ("auto", "grouped_mm", "batched_mm", "eager")
PHASE_KEYS = ("sft_batch", "sft_seq", "prompts", "rollouts", "prompt_len", "max_new_tokens", "micro_batch",
              "gen_batch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m recipe.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--size", choices=sorted(SIZES), default="mid")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="model dtype, trainer and engine alike (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--trainer", choices=TRAINERS, default="fsdp",
                   help="fsdp (default): the trainer as on ranks, FSDP2 mixed precision (float32 master weights, "
                        "each layer gathered in --dtype) on a process group of one rank; autocast: as one process "
                        "trains, float32 parameters under torch.autocast")
    p.add_argument("--experts", choices=EXPERTS, default="auto",
                   help="transformers' experts_implementation for the routed experts (auto: transformers' choice)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (SFT only: needs --rl-steps 0)")
    p.add_argument("--keep-gathered", action="store_true",
                   help="trainer fsdp: keep each layer's gathered bf16 weights from forward to backward "
                        "(reshard_after_forward=False: one gather a step instead of two)")
    p.add_argument("--fused-adamw", action="store_true", help="SFT: torch's fused AdamW (default: foreach)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, one more SFT step and RL train step under torch.profiler: "
                        "kernel time by kind, the top kernels")
    p.add_argument("--sft-steps", type=int, default=5, help="timed SFT steps (after one untimed warm-up step)")
    p.add_argument("--rl-steps", type=int, default=3,
                   help="RL steps (0: SFT only); with more than one the first is left out of the rates (warm-up)")
    p.add_argument("--peak-tflops", type=float, default=H200_PEAK_BF16_TFLOPS,
                   help=f"peak TFLOP/s for MFU (default {H200_PEAK_BF16_TFLOPS:g}: H200 dense bf16)")
    p.add_argument("--lr", type=float, default=None, help="RL learning rate (default: preset=intellect3's rl.lr)")
    p.add_argument("--sft-lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json if OUT is set, else "
                                                "./gpu_check.json)")
    for k in PHASE_KEYS:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help="default: the size's")
    args = p.parse_args(argv)
    for k in PHASE_KEYS:
        if getattr(args, k) is None:
            setattr(args, k, SIZES[args.size][k])
    if args.sft_steps < 1 or args.rl_steps < 0:
        p.error("--sft-steps must be at least 1 and --rl-steps at least 0")
    if args.keep_gathered and args.trainer != "fsdp":
        p.error("--keep-gathered is a setting of --trainer fsdp (FSDP2's gathers)")
    if args.compile and args.rl_steps:
        p.error("--compile times SFT only: add --rl-steps 0 (the RL step's shapes change every step)")
    if args.out is None:
        args.out = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    return args


def no_cuda_error() -> str | None:
    """The one line for --device cuda on a machine where torch sees no GPU; None when it sees one."""
    import torch  # (torch alone: the check below runs before the module's other imports)

    if torch.cuda.is_available():
        return None
    return (f"gpu_check: error: --device cuda, but torch {torch.__version__} sees no CUDA device "
            f"(torch.cuda.is_available() is False); --device cpu --size tiny runs the check on the CPU")


if __name__ == "__main__":
    # `python -m recipe.gpu_check`: wrong flags, and --device cuda without a GPU, fail before transformers and the
    # recipe's modules are imported (about 8 s of CPU)
    if parse_args().device == "cuda" and (error := no_cuda_error()):
        print(error, file=sys.stderr)
        sys.exit(2)

import torch
import torch.distributed as dist
import transformers

from recipe.chat import SPECIAL_TOKENS, stop_token_ids
from recipe.config import TinyArch, load_config
from recipe.gpu_profile import profile_call, synced_clock
from recipe.inference.hf import HFEngine
from recipe.model import build_tiny_model, build_tokenizer
from recipe.rl.dist import World, decoder_layers, shard_model
from recipe.rl.loss import completion_logprobs
from recipe.rl.orchestrator import Sample
from recipe.rl.trainer import build_optimizer, full_state_dict, publish_weights, scheduler_for, train_step
from recipe.rollout import SamplingParams


def active_params(model) -> tuple[int, int, int]:
    """(total, active a token, input embedding) parameter counts; see the module docstring for the convention."""
    cfg = model.config
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    total = active = embed = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if "embed_tokens" in name:
            embed += n
        elif ".mlp.experts." in name:  # stacked [E, ...] routed experts: a token goes through k of them
            active += n * k / e
        else:
            active += n
    return total, int(round(active)), embed


def attention_pairs(prompt_len: int, completion_len: int) -> int:
    """Query-key pairs of a causal sequence's attention, a layer and head: each token sees itself and every
    token before it. prompt_len 0: a whole sequence of completion_len tokens."""
    n, p = completion_len, prompt_len
    return n * p + n * (n + 1) // 2 + p * (p + 1) // 2 if p else n * (n + 1) // 2


def attention_flops(pairs: int, config, passes: int) -> float:
    """The attention scores' and their weighted sum's FLOPs (QK^T and AV: 4 * head_dim a query-key pair and head),
    over every layer; passes: 3 for training (a forward and a backward of twice its cost), 1 for a forward."""
    heads, head_dim = config.num_attention_heads, config.head_dim
    return 4.0 * head_dim * heads * config.num_hidden_layers * pairs * passes


def _rate(tokens: int, seconds: float, n_active: int, flops_per_param: int, peak_tflops: float,
          attn_flops: float = 0.0) -> dict:
    """Tokens/s and MFU under the module docstring's convention, and beside it the MFU that also counts the
    attention scores' FLOPs (attn_flops: causal, as attention_flops counts them)."""
    flops = flops_per_param * n_active * tokens
    tflops = flops / seconds / 1e12 if seconds > 0 else 0.0
    tflops_attn = (flops + attn_flops) / seconds / 1e12 if seconds > 0 else 0.0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "tflops": tflops, "mfu": tflops / peak_tflops, "attention_tflop": attn_flops / 1e12,
            "tflops_with_attention": tflops_attn, "mfu_with_attention": tflops_attn / peak_tflops}


def _matmul_tflops(device) -> float | None:
    """One 8192^3 bf16 matrix product's rate on this GPU (mean of 10 after 3 warm-ups), for comparison."""

    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t0 = synced_clock(device)
    for _ in range(10):
        a @ b
    dt = (synced_clock(device) - t0) / 10
    del a, b
    torch.cuda.empty_cache()
    return 2 * 8192 ** 3 / dt / 1e12


def _peak_mem(device) -> float | None:

    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def _reset_peak(device) -> None:

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _git_commit() -> str | None:
    """The commit the check runs at: GPU_CHECK_COMMIT when set (the device machine's copy of the tree may hold an
    older .git than its files), else `git rev-parse HEAD`."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _print_profile(what: str, prof: dict) -> None:
    kinds = ", ".join(f"{k} {1000 * v:.1f}ms" for k, v in prof["by_kind_s"].items())
    print(f"gpu_check: profile of {what}: wall {1000 * prof['wall_s']:.1f}ms, busy {100 * prof['busy_share']:.0f}%; "
          f"{kinds}", flush=True)
    for t in prof["top"][:8]:
        print(f"gpu_check:   {1000 * t['s']:8.2f}ms {100 * t['share']:5.1f}%  {t['name']}", flush=True)


@dataclass(frozen=True)
class OneRankWorld(World):
    """A process group of one rank, taken as distributed: train_step, publish_weights and the optimizer take the
    ranks' path (FSDP2's DTensors, collectives, no autocast, no shared-prompt pass), as on the production run's
    ranks, with one GPU."""

    @property
    def distributed(self) -> bool:
        return True


def join_one_rank_group(device) -> OneRankWorld:
    """A process group of this process alone (NCCL on a GPU, gloo on the CPU), on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
    return OneRankWorld(rank=0, size=1, device=device)


def build(args, device):
    """The recipe's tokenizer and model (recipe.model); the model built on the device, its vocabulary padded to
    the size's (as GLM-4.5 pads its 151329 tokens to 151552 embedding rows). Float32 parameters: the master
    weights, as the trainer holds them (recipe.rl.dist.load_sharded)."""

    texts = [f"{a} + {b} = {a + b}" for a in range(40) for b in range(10)] + ["the quick brown fox"] * 10
    arch = TinyArch(**SIZES[args.size]["arch"])
    tokenizer = build_tokenizer(texts, vocab_size=512)
    with torch.device(device):  # parameters made (and initialised) where they will live
        model = build_tiny_model(arch, tokenizer, seed=args.seed)
        if arch.vocab_size > model.config.vocab_size:
            model.resize_token_embeddings(arch.vocab_size, mean_resizing=False)
    if args.experts != "auto":
        model.set_experts_implementation(args.experts)
    return model, tokenizer, arch


def sft_phase(model, args, device, dtype, low: int, vocab: int, n_active: int) -> dict:
    """SFT steps on random tokens. trainer fsdp: FSDP2 casts each layer to `dtype` itself; autocast: the float32
    parameters under torch.autocast (as the one-process Trainer's bf16)."""

    # fused: one kernel for the whole update where torch has it (--fused-adamw); else torch's default, foreach
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0, fused=args.fused_adamw or None)
    gen = torch.Generator().manual_seed(args.seed)
    autocast = args.trainer == "autocast" and dtype != torch.float32
    model.train()
    losses, t0, step_s, opt_s = [], None, [], []

    def one_step(ids):
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        to = synced_clock(device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt_s.append(synced_clock(device) - to)
        return float(loss.detach())

    for step in range(args.sft_steps + 1):  # step 0: warm-up (and compilation), untimed
        ids = torch.randint(low, vocab, (args.sft_batch, args.sft_seq), generator=gen).to(device)
        ts = synced_clock(device)
        if step == 1:
            t0 = ts
        losses.append(one_step(ids))  # (a sync: the step's time is all of it)
        step_s.append(synced_clock(device) - ts)
        print(f"gpu_check: sft step {step}{' (warm-up)' if step == 0 else ''}: loss {losses[-1]:.4f}, "
              f"{step_s[-1]:.3f}s (optimizer {opt_s[-1]:.3f}s)", flush=True)
    seconds = synced_clock(device) - t0
    profiled = None
    if args.profile:  # one more step, untimed, under the profiler
        ids = torch.randint(low, vocab, (args.sft_batch, args.sft_seq), generator=gen).to(device)
        profiled = profile_call(lambda: one_step(ids), device)
        profiled["optimizer_s"] = opt_s[-1]
        _print_profile(f"an SFT step (optimizer {opt_s[-1]:.3f}s of it)", profiled)
    tokens = args.sft_steps * args.sft_batch * args.sft_seq
    attn = attention_flops(args.sft_steps * args.sft_batch * attention_pairs(0, args.sft_seq), model.config, 3)
    return {"steps": args.sft_steps, "warmup_steps": 1, "batch": args.sft_batch, "seq_len": args.sft_seq,
            "optimizer": "torch.optim.AdamW, plain torch loop (TRL is not on the GPU machine)",
            "losses": losses, "loss": losses[-1], "step_s": step_s[:args.sft_steps + 1],
            "optimizer_s": opt_s[1:args.sft_steps + 1], "profile": profiled,
            **_rate(tokens, seconds, n_active, 6, args.peak_tflops, attn)}


def probe_logprob(model, ids: list[int], n_prompt: int, temperature: float, device) -> float:
    """Sum of the completion tokens' logprobs (recipe.rl.loss.completion_logprobs, as the trainer scores them)."""

    with torch.no_grad():
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x, use_cache=False).logits[:, n_prompt - 1:-1]
        return float(completion_logprobs(logits, x[:, n_prompt:], temperature).sum())


def rl_phase(model, engine_model, tokenizer, args, device, dtype, world: World, low: int, vocab: int,
             n_active: int, work: Path, on_step=lambda steps: None) -> dict:
    """RL steps as recipe.rl.loop runs them (module docstring). world: OneRankWorld for trainer fsdp (FSDP2's
    mixed precision casts), World() for autocast (train_step's compute_dtype). on_step(steps) after each step:
    the steps so far, written down in case the run is stopped before it ends."""

    overrides = ["preset=intellect3", f"rl.micro_batch_size={args.micro_batch}"]
    if args.lr is not None:
        overrides.append(f"rl.lr={args.lr}")
    rl = load_config(overrides).rl
    compute_dtype = None if world.distributed else dtype
    engine = HFEngine(engine_model, tokenizer, stop_token_ids(tokenizer), batch_size=args.gen_batch)
    optimizer = build_optimizer(model, rl)
    schedulers = scheduler_for(optimizer, rl)
    gen = torch.Generator().manual_seed(args.seed + 1)
    steps, probe = [], None
    for s in range(args.rl_steps):
        prompts = [torch.randint(low, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
        batch = [p for p in prompts for _ in range(args.rollouts)]
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=rl.temperature, top_p=1.0,
                                seed=args.seed + 100_000 * s)
        t0 = synced_clock(device)
        completions = engine.generate(batch, params)
        t1 = synced_clock(device)
        gen_tokens = sum(len(c.token_ids) for c in completions)
        # a synthetic verifiable reward (the share of even token ids) and GRPO's group-relative advantage
        samples = []
        for g in range(args.prompts):
            group = completions[g * args.rollouts:(g + 1) * args.rollouts]
            rewards = [sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1) for c in group]
            mean = sum(rewards) / len(rewards)
            samples += [Sample(prompt_ids=prompts[g], completion_ids=c.token_ids, logprobs=c.logprobs,
                               loss_mask=list(c.loss_mask), advantage=r - mean, reward=r,
                               policy_version=c.policy_version, env="synthetic") for c, r in zip(group, rewards)]
        if probe is None:
            probe = (samples[0].prompt_ids + samples[0].completion_ids, len(samples[0].prompt_ids))
            probe_before = probe_logprob(engine.model, *probe, rl.temperature, device)
        train_tokens = sum(len(x.prompt_ids) + len(x.completion_ids) for x in samples)
        t2 = synced_clock(device)
        stats = train_step(model, optimizer, schedulers, device, samples, rl, tokenizer.pad_token_id, world=world,
                           compute_dtype=compute_dtype)
        t3 = synced_clock(device)
        with torch.no_grad():  # how much of what the engine serves this step moved (it holds the version before)
            served = engine.model.state_dict()
            trained = full_state_dict(model, world, dtype)
            moved = sum(int((trained[k].to(v.device) != v).sum()) for k, v in served.items())
            total = sum(v.numel() for v in served.values())
            del trained
        t4 = synced_clock(device)
        path = publish_weights(model, work / "weights", s + 1, world=world, dtype=dtype)
        t5 = synced_clock(device)
        engine.update_weights(path, s + 1)
        t6 = synced_clock(device)
        step = {"step": s + 1, "samples": len(samples), "gen_tokens": gen_tokens, "gen_s": t1 - t0,
                "train_tokens": train_tokens, "loss_tokens": stats["loss_tokens"], "train_s": t3 - t2,
                "publish_s": t5 - t4, "reload_s": t6 - t5, "changed_fraction": moved / total,
                "gen_pairs": sum(attention_pairs(len(x.prompt_ids), len(x.completion_ids)) -
                                 attention_pairs(0, len(x.prompt_ids)) for x in samples),
                "train_pairs": sum(attention_pairs(0, len(x.prompt_ids) + len(x.completion_ids)) for x in samples),
                **{k: stats[k] for k in ("loss", "grad_norm", "mean_ratio", "masked_share", "lr")}}
        steps.append(step)
        on_step(steps)
        print(f"gpu_check: rl step {s + 1}: {gen_tokens} tokens generated in {step['gen_s']:.2f}s, "
              f"train {step['train_s']:.2f}s (loss {step['loss']:.4g}, mean ratio {step['mean_ratio']:.4f}), "
              f"publish {step['publish_s']:.2f}s, reload {step['reload_s']:.2f}s, "
              f"{100 * step['changed_fraction']:.1f}% of weights moved", flush=True)
    timed = steps[1:] if len(steps) > 1 else steps
    moved = max(x["changed_fraction"] for x in steps)
    if moved < 0.5:  # float32 master weights move every step; their `dtype` copy only once the steps add up
        print(f"gpu_check: note: an RL step moved at most {100 * moved:.1f}% of the served weights at lr {rl.lr:g} in "
              f"{dtype}: the float32 master weights keep the rest until it adds up to a unit in the last place",
              flush=True)
    with torch.no_grad():
        trained = full_state_dict(model, world, dtype)
        engine_matches = all(torch.equal(trained[k].to(v.device), v) for k, v in engine.model.state_dict().items())
        del trained
    probe_after = probe_logprob(engine.model, *probe, rl.temperature, device)
    probe_trainer = probe_logprob(model, *probe, rl.temperature, device)
    profiled = None
    if args.profile:  # one more train step on the last batch, untimed, under the profiler; its optimizer timed
        step_opt = optimizer.step
        opt_time = []

        def timed_step(*a, **kw):
            to = synced_clock(device)
            out = step_opt(*a, **kw)
            opt_time.append(synced_clock(device) - to)
            return out

        optimizer.step = timed_step
        profiled = profile_call(lambda: train_step(model, optimizer, schedulers, device, samples, rl,
                                                   tokenizer.pad_token_id, world=world, compute_dtype=compute_dtype),
                                device)
        optimizer.step = step_opt
        profiled["optimizer_s"] = opt_time[0]
        _print_profile(f"an RL train step (optimizer {rl.optimizer}: {opt_time[0]:.3f}s of it)", profiled)
    weights_bytes = sum(f.stat().st_size for f in (work / "weights").rglob("*.safetensors")) / (
        len(list((work / "weights").glob("policy_*"))) or 1)
    cfg = model.config
    return {
        "steps": steps, "timed_steps": [x["step"] for x in timed],
        "settings": {"preset": "intellect3", "optimizer": str(rl.optimizer), "lr": rl.lr,
                     "temperature": rl.temperature, "micro_batch_size": rl.micro_batch_size,
                     "prompts": args.prompts, "rollouts_per_prompt": args.rollouts, "prompt_len": args.prompt_len,
                     "max_new_tokens": args.max_new_tokens, "gen_batch_size": args.gen_batch,
                     "shared_prompt_pass": bool(rl.share_prompts and not world.distributed)},
        "generate": _rate(sum(x["gen_tokens"] for x in timed), sum(x["gen_s"] for x in timed), n_active, 2,
                          args.peak_tflops, attention_flops(sum(x["gen_pairs"] for x in timed), cfg, 1)),
        "train": _rate(sum(x["train_tokens"] for x in timed), sum(x["train_s"] for x in timed), n_active, 6,
                       args.peak_tflops, attention_flops(sum(x["train_pairs"] for x in timed), cfg, 3)),
        "publish_s": sum(x["publish_s"] for x in timed) / len(timed),
        "reload_s": sum(x["reload_s"] for x in timed) / len(timed),
        "weights_gb": weights_bytes / 2 ** 30,
        "loss": steps[-1]["loss"],
        "engine_matches_trainer": engine_matches,
        "probe_logprob_before": probe_before, "probe_logprob_after": probe_after,
        "probe_logprob_trainer": probe_trainer, "train_profile": profiled,
    }


def table(r: dict) -> str:
    rows = [("sft train", r["sft"])]
    if "rl" in r:
        rows += [("rl generate", r["rl"]["generate"]), ("rl train", r["rl"]["train"])]
    lines = [f"{'phase':<12} {'tokens':>9} {'seconds':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} "
             f"{'MFU+attn':>8}"]
    for name, x in rows:
        lines.append(f"{name:<12} {x['tokens']:>9} {x['seconds']:>8.2f} {x['tokens_per_s']:>10.0f} "
                     f"{x['tflops']:>8.2f} {100 * x['mfu']:>6.2f}% {100 * x['mfu_with_attention']:>7.2f}%")
    if "rl" in r:
        rl = r["rl"]
        lines.append(f"weights: publish {rl['publish_s']:.2f}s, engine reload {rl['reload_s']:.2f}s a step "
                     f"({rl['weights_gb']:.2f} GiB); engine serves the trainer's weights: "
                     f"{rl['engine_matches_trainer']}; probe logprob {rl['probe_logprob_before']:.4f} -> "
                     f"{rl['probe_logprob_after']:.4f}")
    mem = r.get("peak_memory_gb")
    lines.append(f"trainer: {r['trainer']}; experts: {r['model']['experts_implementation']}; compiled layers: "
                 f"{r['compile']}")
    lines.append(f"MFU: {r['flops_convention']}; peak {r['peak_tflops']:g} TFLOP/s ({r['peak_tflops_source']})"
                 + (f"; measured bf16 matmul {r['matmul_bf16_tflops']:.0f} TFLOP/s" if r.get("matmul_bf16_tflops")
                    else ""))
    lines.append(f"peak memory: {f'{mem:.2f} GiB on the GPU' if mem is not None else 'n/a'}; "
                 f"peak RSS {r['peak_rss_gb']:.2f} GiB; total {r['total_s']:.1f}s")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)

    if args.device == "cuda" and (error := no_cuda_error()):
        print(error, file=sys.stderr)
        return 2

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    peak_source = ("H100/H200 SXM datasheet, dense bf16" if args.peak_tflops == H200_PEAK_BF16_TFLOPS
                   else "--peak-tflops")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(), "argv": sys.argv[1:] if argv is None else list(argv),
        "device": args.device, "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                               else platform.processor() or platform.machine()),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "python": platform.python_version(), "dtype": str(dtype).removeprefix("torch."), "size": args.size,
        "trainer": args.trainer, "compile": args.compile, "keep_gathered": args.keep_gathered,
        "fused_adamw": args.fused_adamw,
        "peak_tflops": args.peak_tflops, "peak_tflops_source": peak_source,
        "flops_convention": "6*N_active*tokens (train), 2*N_active*tokens (generate); N_active: non-embedding "
                            "parameters a token uses (top-k of the routed experts, lm_head in, embed_tokens "
                            "out); attention-score FLOPs not counted (MFU+attn counts them too: 4*head_dim*heads "
                            "a causal query-key pair and layer, x3 in training)",
    }
    out = Path(args.out)

    def write():
        out.parent.mkdir(parents=True, exist_ok=True)
        result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        result["total_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(result, indent=2, default=str))

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    world = World(device=device)
    try:
        result["matmul_bf16_tflops"] = _matmul_tflops(device)
        t0 = synced_clock(device)
        model, tokenizer, arch = build(args, device)
        result["build_s"] = synced_clock(device) - t0
        total, n_active, embed = active_params(model)
        # random tokens above the special ones (which come first: recipe.model.build_tokenizer), so no prompt holds
        # a stop or pad token; a sampled completion may still stop early
        low = max(tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)) + 1
        vocab = model.config.vocab_size
        result["model"] = {"class": type(model).__name__, "arch": vars(arch) | {"vocab_size": vocab},
                           "params_total": total, "params_active": n_active, "params_embedding": embed,
                           "attn_implementation": model.config._attn_implementation,
                           "experts_implementation": getattr(model.config, "_experts_implementation", None)}
        print(f"gpu_check: {result['device_name']}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, {result['dtype']}; {type(model).__name__} ({args.size}): "
              f"{total / 1e9:.3f}B parameters, {n_active / 1e9:.3f}B active a token; built in "
              f"{result['build_s']:.1f}s; trainer {args.trainer}, experts "
              f"{result['model']['experts_implementation']}{', compiled layers' if args.compile else ''}", flush=True)
        # the engine's copy, made before sharding (an FSDP2 module is not copied); it takes the trainer's weights
        # after SFT, as the RL stage starts both from the SFT model
        engine_model = copy.deepcopy(model).to(dtype).eval().requires_grad_(False) if args.rl_steps else None
        if args.compile:
            for layer in decoder_layers(model):
                layer.compile()
        if args.trainer == "fsdp":
            world = join_one_rank_group(device)
            shard_model(model, world, 1, dtype, reshard_after_forward=not args.keep_gathered)
        _reset_peak(device)
        result["sft"] = sft_phase(model, args, device, dtype, low, vocab, n_active)
        result["sft"]["peak_memory_gb"] = _peak_mem(device)
        result["peak_memory_gb"] = result["sft"]["peak_memory_gb"]
        result["ok"] = math.isfinite(result["sft"]["loss"])
        result["finished"] = not args.rl_steps  # until the RL steps are done too
        write()

        def rl_progress(steps):
            result["rl_steps_so_far"] = steps
            write()

        if args.rl_steps:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            engine_model.load_state_dict(full_state_dict(model, world, dtype))
            _reset_peak(device)
            result["rl"] = rl_phase(model, engine_model, tokenizer, args, device, dtype, world, low, vocab,
                                    n_active, work, rl_progress)
            del result["rl_steps_so_far"]
            result["finished"] = True
            result["rl"]["peak_memory_gb"] = _peak_mem(device)
            peaks = [x for x in (result["sft"]["peak_memory_gb"], result["rl"]["peak_memory_gb"]) if x is not None]
            result["peak_memory_gb"] = max(peaks) if peaks else None
            result["ok"] = bool(result["ok"] and result["rl"]["engine_matches_trainer"]
                                and math.isfinite(result["rl"]["loss"]))
    except BaseException as e:
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
        write()
        print(f"gpu_check: failed; what was measured is in {out}", file=sys.stderr)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()
    write()
    print(table(result))
    print(f"gpu_check: {'ok' if result['ok'] else 'FAILED'}; wrote {out}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
