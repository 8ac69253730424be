"""The RL loop: asynchronous GRPO from a start model, resumable from its newest checkpoint.

The orchestrator assembles the batch for step s from groups the engine wrote with policy versions
>= s - max_async_level; the trainer takes one optimizer step on it; the new weights are published to the engine
as version s + 1. The engine keeps generating the next groups while the trainer works (engine process of its
own on CPU; vLLM server on GPUs). `make rl` (recipe.rl.__main__) and `make bench-rl` (recipe.rl.bench) run it.
"""
from __future__ import annotations

import os
import time

import torch
from accelerate import Accelerator
from tqdm import tqdm

from recipe.config import EngineKind
from recipe.data.schema import read_split
from recipe.inference.vllm import VLLMEngine
from recipe.inference.worker import HFEngineProcess
from recipe.model import load_pretrained
from recipe.rl.orchestrator import Orchestrator
from recipe.rl.trainer import (build_optimizer, build_scheduler, latest_checkpoint, load_checkpoint,
                               publish_weights, save_checkpoint, train_step)
from recipe.runs import STOP, MetricsLog, release_free_memory, require_done
from recipe.sandbox.runner import run_on_cores


def make_engine(cfg, model_path, version: int, log_dir):
    """The engine the orchestrator drives: the hf engine in a process of its own, or vLLM server(s)."""
    rl = cfg.rl
    if rl.engine == EngineKind.hf:
        cpu = 1 if rl.pin_cores and (os.cpu_count() or 1) > 1 else None
        return HFEngineProcess(str(model_path), threads=rl.gen_threads, batch_size=rl.gen_batch_size,
                               max_off_policy_steps=rl.max_off_policy_steps, version=version, cpu=cpu)
    urls = os.environ.get("RECIPE_VLLM_URLS")  # servers the SLURM launcher started on inference nodes
    if urls:
        return VLLMEngine(str(model_path), cfg, version=version, launch=False, base_url=urls)
    return VLLMEngine(str(model_path), cfg, version=version, log_path=log_dir / "vllm_server.log")


def run_rl(cfg, stage_dir, start_model):
    """The RL loop itself; returns the final model folder. Resumes from the newest checkpoint in stage_dir."""
    rl = cfg.rl
    torch.manual_seed(rl.seed)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(rl.train_threads)
    cores_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    pin = rl.pin_cores and cores_before is not None and (os.cpu_count() or 1) > 1
    if pin:
        os.sched_setaffinity(0, {0})  # the engine process takes core 1
        run_on_cores(cores_before)  # sandboxed programs (code rewards, the python tool) go where there is room
    try:
        return _rl_loop(cfg, stage_dir, start_model)
    finally:  # give the cores back: a caller (the bench's eval) runs with all its threads afterwards
        if pin:
            os.sched_setaffinity(0, cores_before)
            run_on_cores(None)
        torch.set_num_threads(threads_before)


def _rl_loop(cfg, stage_dir, start_model):
    rl = cfg.rl
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, tokenizer = load_pretrained(str(start_model), dtype=cfg.model.dtype,
                                       attn_implementation=cfg.model.attn_implementation)
    model = accelerator.prepare(model)
    optimizer = build_optimizer(model, rl)  # after prepare: under FSDP2 the parameters are the sharded ones
    schedulers = build_scheduler(optimizer, rl.warmup_steps)
    ckpt_root, weights_dir = stage_dir / "checkpoints", stage_dir / "weights"
    step, orch_state = 0, None
    last = latest_checkpoint(ckpt_root)
    if last is not None:
        step, orch_state = load_checkpoint(last, accelerator.unwrap_model(model), optimizer, schedulers)
        print(f"rl: resuming from {last} (step {step})")
    metrics = MetricsLog(stage_dir / "metrics.jsonl", resume_step=step if last else None)
    engine = make_engine(cfg, start_model, version=0, log_dir=stage_dir)
    orch = None
    try:
        if step > 0:
            engine.update_weights(publish_weights(accelerator.unwrap_model(model), weights_dir, step), step)
        rows = read_split(require_done(cfg, "data"), "rl")
        context = accelerator.unwrap_model(model).config.max_position_embeddings
        served = getattr(engine, "context", None)  # vLLM servers may take less (--max-model-len)
        orch = Orchestrator(rows, tokenizer, rl, engine, seed=rl.seed, max_pass_rate=rl.max_pass_rate,
                            context=context if served is None else min(context, served))
        if orch_state:
            orch.load_state_dict(orch_state)
        orch.start()
        print(f"rl: {sum(len(v) for v in orch.rows.values())} prompts "
              f"({orch.offline_dropped} dropped by the offline pass-rate filter); env mix {dict(rl.env_mix)}")
        bar = tqdm(total=rl.max_steps, initial=step, desc="rl", unit="step")
        t_start = time.perf_counter()
        saved = step
        with STOP.cooperative():  # SIGTERM/SIGINT: finish the step, checkpoint it, stop
            while step < rl.max_steps:
                t0 = time.perf_counter()
                samples, gen_stats = orch.next_batch(step)
                t1 = time.perf_counter()
                train_stats = train_step(model, optimizer, schedulers, accelerator, samples, rl,
                                         tokenizer.pad_token_id)
                t2 = time.perf_counter()
                step += 1
                engine.update_weights(publish_weights(accelerator.unwrap_model(model), weights_dir, step), step)
                release_free_memory()  # the step's activations: RSS stays flat over a long run (make soak)
                lens = [len(s.completion_ids) for s in samples]
                record = {"step": step, **gen_stats, **train_stats,
                          "completion_len_mean": sum(lens) / len(lens), "completion_len_max": max(lens),
                          "gen_wait_s": t1 - t0, "train_s": t2 - t1, "step_s": time.perf_counter() - t0,
                          "samples_per_s": len(samples) / (time.perf_counter() - t0),
                          "elapsed_s": time.perf_counter() - t_start}
                if step % rl.checkpoint_every == 0 or step == rl.max_steps or STOP.requested:
                    save_checkpoint(ckpt_root, step, accelerator.unwrap_model(model), optimizer, schedulers,
                                    orch.state_dict(), rl.keep_checkpoints)
                    saved = step
                metrics.log(record)  # after the checkpoint, so a resumed run never logs a step twice
                bar.set_postfix(reward=f"{gen_stats['reward']:.3f}", masked=f"{train_stats['masked_share']:.3f}",
                                stale=str(gen_stats["staleness"]))
                bar.update(1)
                if STOP.requested:
                    if saved != step:  # the signal came after this step's checkpoint decision
                        save_checkpoint(ckpt_root, step, accelerator.unwrap_model(model), optimizer, schedulers,
                                        orch.state_dict(), rl.keep_checkpoints)
                    bar.close()
                    STOP.stop(f"the next run resumes from checkpoint {latest_checkpoint(ckpt_root)} (step {step})")
        bar.close()
    finally:
        if orch is not None:
            orch.close()
        engine.close()
    out = stage_dir / "model"
    accelerator.unwrap_model(model).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
