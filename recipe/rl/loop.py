"""The RL loop: asynchronous GRPO from a start model, resumable from its newest checkpoint, on one or more ranks.

The orchestrator assembles the batch for step s from groups the engine wrote with policy versions
>= s - max_async_level; the trainer takes one optimizer step on it; the new weights are published to the engine
as version s + 1. The engine keeps generating the next groups while the trainer works (engine process of its
own on CPU; vLLM server on GPUs). `make rl` (recipe.rl.__main__) and `make bench-rl` (recipe.rl.bench) run it.

With several ranks (recipe.rl.dist) rank 0 alone runs the orchestrator, talks to the engine and writes metrics;
every step it splits the batch into token-balanced shares, one a rank, and all ranks step the FSDP2-sharded
model together (docs/architecture.md, "Ranks").

With rl.eval_every, rank 0 also evaluates the policy every so many steps through the same engine
(recipe.rl.eval_during), after the step's weights are published and its checkpoint written.
"""
from __future__ import annotations

import os
import time

import torch
from tqdm import tqdm

from recipe.config import EngineKind
from recipe.data.schema import read_split
from recipe.inference.vllm import VLLMEngine, run_servers_on
from recipe.inference.worker import HFEngineProcess
from recipe.launch.roles import INFERENCE_URLS_ENV
from recipe.rl import eval_during
from recipe.rl.dist import World, load_sharded, split_by_tokens
from recipe.rl.orchestrator import Orchestrator
from recipe.rl.trainer import (build_optimizer, scheduler_for, full_state_dict, latest_checkpoint,
                               load_checkpoint, publish_weights, save_checkpoint, train_step)
from recipe.runs import STOP, MetricsLog, PeriodicTrim, huge_pages, require_done
from recipe.sandbox.runner import run_on_cores
from recipe.tracking import Tracker


def make_engine(cfg, model_path, version: int, log_dir):
    """The engine the orchestrator drives: the policy servers a SLURM job started (RECIPE_INFERENCE_URLS: vLLM, or
    the hf engine's server on CPU nodes, both spoken to over vLLM's HTTP API), else one of its own: the hf engine
    in a process of its own, or a vLLM server."""
    rl = cfg.rl
    urls = os.environ.get(INFERENCE_URLS_ENV)
    if urls:
        return VLLMEngine(str(model_path), cfg, version=version, launch=False, base_url=urls)
    if rl.engine == EngineKind.hf:
        cpu = 1 if rl.pin_cores and (os.cpu_count() or 1) > 1 else None
        return HFEngineProcess(str(model_path), threads=rl.gen_threads, batch_size=rl.gen_batch_size,
                               max_off_policy_steps=None if rl.staleness == "prime_rl" else rl.max_off_policy_steps,
                               version=version, cpu=cpu)
    return VLLMEngine(str(model_path), cfg, version=version, log_path=log_dir / "vllm_server.log")


def run_rl(cfg, stage_dir, start_model, world: World = World(), tracker: Tracker = Tracker()):
    """The RL loop itself; returns the final model folder. Resumes from the newest checkpoint in stage_dir. With
    several ranks every rank calls it, with its World. tracker (rank 0's, recipe.tracking): gets every step's
    record and every eval's, at their step; the default logs nothing."""
    rl = cfg.rl
    torch.manual_seed(rl.seed)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(rl.train_threads)
    cores_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    # one process: the trainer on core 0, the engine on core 1; several ranks share the cores unpinned
    pin = rl.pin_cores and cores_before is not None and (os.cpu_count() or 1) > 1 and not world.distributed
    if pin:
        os.sched_setaffinity(0, {0})  # the engine process takes core 1
        run_on_cores(cores_before)  # sandboxed programs (code rewards, the python tool) go where there is room
        run_servers_on(set(cores_before) - {0} or cores_before)  # a vLLM server: the trainer's pin is not its own
    try:
        with huge_pages(rl.huge_pages):  # before the loop's first tensor; the engine process it starts takes it too
            return _rl_loop(cfg, stage_dir, start_model, world, tracker)
    finally:  # give the cores back: a caller (the bench's eval) runs with all its threads afterwards
        if pin:
            os.sched_setaffinity(0, cores_before)
            run_on_cores(None)
            run_servers_on(None)
        torch.set_num_threads(threads_before)


def _rl_loop(cfg, stage_dir, start_model, world: World, tracker: Tracker):
    rl = cfg.rl
    model, tokenizer = load_sharded(start_model, world, cfg.launcher.hsdp_replicas, cfg.model.dtype,
                                    cfg.model.attn_implementation, rl.activation_checkpointing)
    compute = getattr(torch, cfg.model.dtype)  # the engines' and the forward's dtype; the parameters are float32
    optimizer = build_optimizer(model, rl)  # after sharding: under FSDP2 the parameters are the sharded ones
    schedulers = scheduler_for(optimizer, rl)
    ckpt_root, weights_dir = stage_dir / "checkpoints", stage_dir / "weights"
    step, orch_state = 0, None
    # rank 0 alone looks (latest_checkpoint removes a damaged one) and names the one every rank loads
    last = world.broadcast(latest_checkpoint(ckpt_root) if world.main else None)
    if last is not None:
        step, orch_state = load_checkpoint(last, model, optimizer, schedulers, world)
        if world.main:
            print(f"rl: resuming from {last} (step {step})")
    metrics = MetricsLog(stage_dir / "metrics.jsonl", resume_step=step if last else None) if world.main else None
    if world.main and last is None:
        eval_during.clear(stage_dir)  # a fresh run: no eval records of an earlier run in this folder
    # eval during RL (rl.eval_every): its problems are in hand before the engine starts (a hub failure costs seconds)
    evals = eval_during.start(cfg, stage_dir, step if last else None) if world.main else None
    engine = make_engine(cfg, start_model, version=0, log_dir=stage_dir) if world.main else None
    orch, context = None, None

    def publish(version: int) -> None:  # every rank gives its shards; rank 0 writes and tells the engine
        path = publish_weights(model, weights_dir, version, world=world, dtype=compute)
        if world.main:
            engine.update_weights(path, version)

    def checkpoint() -> None:
        save_checkpoint(ckpt_root, step, model, optimizer, schedulers, orch.state_dict() if world.main else {},
                        rl.keep_checkpoints, world)

    try:
        if step > 0:
            publish(step)
        if world.main:
            rows = read_split(require_done(cfg, "data"), "rl")
            context = model.config.max_position_embeddings
            served = getattr(engine, "context", None)  # vLLM servers may take less (--max-model-len)
            context = context if served is None else min(context, served)
            if evals is not None:  # the orchestrator and the eval share the engine, each seeing its own requests
                engine = eval_during.SharedEngine(engine)
            orch = Orchestrator(rows, tokenizer, rl, engine, seed=rl.seed,  # rl.seq_len bounds the context too
                                context=context)
            if orch_state:
                orch.load_state_dict(orch_state)
            orch.start()
            ranks = f"; {world.size} trainer ranks" if world.distributed else ""
            print(f"rl: {sum(len(v) for v in orch.rows.values())} prompts; env mix {dict(rl.env_mix)}{ranks}")
        bar = tqdm(total=rl.max_steps, initial=step, desc="rl", unit="step", disable=not world.main)
        t_start = time.perf_counter()
        saved = step
        trim = PeriodicTrim()

        def evaluate_policy() -> dict:
            """Rank 0: the eval due at this step (the engine holds this step's weights), for the step's record."""
            if evals is None or not evals.due(step) or STOP.requested:
                return {}
            done = evals.run(engine, tokenizer, step, context)
            if done is not None:
                tracker.log({f"eval/{key}": v for key, v in done.items() if key != "step"}, step)
            k = rl.eval_samples
            return {} if done is None or done[f"avg@{k}"] is None else {"eval_avg": done[f"avg@{k}"]}

        with STOP.cooperative():  # SIGTERM/SIGINT: finish the step, checkpoint it, stop (every rank agrees)
            evaluate_policy()  # step 0 (the start model), or a resumed step whose eval did not finish
            while step < rl.max_steps:
                t0 = time.perf_counter()
                samples, gen_stats = orch.next_batch(step) if world.main else (None, None)
                t1 = time.perf_counter()
                share = world.scatter(split_by_tokens(samples, world.size) if world.main else None)
                train_stats = train_step(model, optimizer, schedulers, world.device, share, rl,
                                         tokenizer.pad_token_id, world, compute)
                t2 = time.perf_counter()
                step += 1
                publish(step)
                t_published = time.perf_counter()
                trim()  # the freed activations, now and then: RSS stays flat over a long run (make soak)
                if step % rl.checkpoint_every == 0 or step == rl.max_steps or world.any(STOP.requested):
                    checkpoint()
                    saved = step
                if world.main:
                    t3 = time.perf_counter()
                    evaluated = evaluate_policy()  # after the checkpoint: a stop during it loses no step
                    if evaluated:
                        evaluated["eval_s"] = time.perf_counter() - t3
                    lens = [len(s.completion_ids) for s in samples]
                    record = {"step": step, **gen_stats, **train_stats, **evaluated,
                              "completion_len_mean": sum(lens) / len(lens), "completion_len_max": max(lens),
                              "gen_wait_s": t1 - t0, "train_s": t2 - t1, "step_s": t3 - t0,  # (the eval apart)
                              # the rest of the step: weights to the engine, then the checkpoint when one is due
                              "publish_s": t_published - t2, "checkpoint_s": t3 - t_published,
                              "samples_per_s": len(samples) / (t3 - t0),
                              "elapsed_s": time.perf_counter() - t_start}
                    metrics.log(record)  # after the checkpoint, so a resumed run never logs a step twice
                    tracker.log(record, step)
                    bar.set_postfix(reward=f"{gen_stats['reward']:.3f}",
                                    masked=f"{train_stats['masked_share']:.3f}", stale=str(gen_stats["staleness"]))
                    bar.update(1)
                if world.any(STOP.requested):
                    if saved != step:  # the signal came after this step's checkpoint decision
                        checkpoint()
                    bar.close()
                    # no rank leaves right after an all-reduce: gloo's thread may still be releasing it, and a rank
                    # freeing the process group then deadlocks at exit (recipe.sft.train_supervised has the story)
                    world.barrier()
                    if not world.main:
                        STOP.stop(f"rank {world.rank} stopped with rank 0 after step {step}")
                    STOP.stop(f"the next run resumes from checkpoint {latest_checkpoint(ckpt_root)} (step {step})")
        bar.close()
    finally:
        if orch is not None:
            orch.close()
        if engine is not None:
            engine.close()
    out = stage_dir / "model"
    state = full_state_dict(model, world, compute)  # (several ranks: the shards gathered, on rank 0)
    if world.main:  # in the model's dtype, as it came in: the float32 master weights were the trainer's
        model.config.dtype = compute
        model.save_pretrained(str(out), state_dict=state)
    if world.main:
        tokenizer.save_pretrained(str(out))
    return out
