"""Typed config schema and composition.

The hydra tree under configs/ is merged into these dataclasses, so an unknown key, a value of the wrong type or
a choice outside its Enum stops with an error that names it, before any stage does work. Checks that span
several keys live in validate(), the one place for them. The paper's benchmarks are checked against their
registry by recipe.eval.benchmarks.validate_benchmarks, which the eval and plan stages call.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from recipe.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


# Closed sets of values. StrEnum members compare equal to their strings and serialise as them, so configs,
# hashes and YAML read as before.
class DataSource(StrEnum):
    tiny = "tiny"
    intellect3 = "intellect3"


class EngineKind(StrEnum):
    hf = "hf"
    vllm = "vllm"


class OptimizerKind(StrEnum):
    adamw = "adamw"
    muon = "muon"


class LauncherKind(StrEnum):
    local = "local"
    slurm = "slurm"


@dataclass
class TinyArch:
    """Sizes of the locally built Glm4MoeForCausalLM (the GLM-4.5-Air architecture, scaled down)."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 96
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    partial_rotary_factor: float = 0.5
    rope_theta: float = 1_000_000.0
    attention_bias: bool = True
    max_position_embeddings: int = 512


@dataclass
class ModelConfig:
    name: str = "tiny-glm4moe"
    # hub_id None means the model is built and pretrained here by `make base` (tiny preset only).
    hub_id: Optional[str] = None
    revision: Optional[str] = None
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    tiny: TinyArch = field(default_factory=TinyArch)
    # size in billions of parameters, for the launcher's memory estimate; null = not stated (tiny is built here)
    params_total_b: Optional[float] = None
    params_active_b: Optional[float] = None


@dataclass
class TaskSpec:
    """One procedural task of the tiny suite."""

    env: str = "math"
    task: str = "add"
    # generator keyword arguments (digits, word lengths, ...)
    params: Dict[str, Any] = field(default_factory=dict)
    difficulty: float = 0.0


@dataclass
class HubDataset:
    id: str = ""
    revision: str = ""
    subsets: List[str] = field(default_factory=list)
    split: str = "train"


@dataclass
class DataConfig:
    source: DataSource = DataSource.tiny
    seed: int = 0
    # tiny: rows per task per split
    sft_rows_per_task: int = 2000
    # share of SFT demonstrations that answer at once, with an empty <think></think>: the SFT data mixes a
    # careful and a hasty demonstrator, and RL has to find out that reasoning first pays
    no_think_fraction: float = 0.0
    # the same for tool-use demonstrations: a share that guesses at once instead of calling the tool (kept
    # apart: a guess and an answer copied from the tool share their format, and too many guesses teach the
    # tiny model to guess after the tool's reply too)
    tool_hasty_fraction: float = 0.0
    rl_rows_per_task: int = 1000
    eval_rows_per_task: int = 100
    pretrain_rows_per_task: int = 3000
    tasks: List[TaskSpec] = field(default_factory=list)
    # appended to tasks (e.g. the tools task), so a run can add one without restating the whole list
    extra_tasks: List[TaskSpec] = field(default_factory=list)
    # intellect3
    sft_dataset: HubDataset = field(default_factory=HubDataset)
    rl_dataset: HubDataset = field(default_factory=HubDataset)
    max_rows: Optional[int] = None  # cap per subset, for smoke runs
    hub_timeout_s: float = 10.0
    # offline difficulty filter: prompts whose precomputed pass rate is above this are dropped
    max_pass_rate: float = 0.874
    pass_rate_column: str = "avg@8_qwen3_4b_thinking_2507"


@dataclass
class TrainConfig:
    """Shared by the `base` (pretraining, tiny only) and `sft` stages; both run on TRL's SFTTrainer."""

    max_steps: int = 300
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    scheduler: str = "cosine"
    max_length: int = 256
    packing: bool = False
    save_steps: int = 100
    save_total_limit: int = 2
    logging_steps: int = 10
    bf16: bool = False
    gradient_checkpointing: bool = False
    threads: int = 2
    seed: int = 0


@dataclass
class RLConfig:
    max_steps: int = 40
    batch_size: int = 16  # prompts (groups) a step
    rollouts_per_example: int = 8
    max_new_tokens: int = 96
    temperature: float = 1.0
    optimizer: OptimizerKind = OptimizerKind.adamw
    lr: float = 2e-4
    warmup_steps: int = 0  # linear warmup, then constant (INTELLECT-3 ran a constant LR)
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    max_async_level: int = 1
    max_off_policy_steps: int = 8
    mask_ratio_low: float = 0.5
    mask_ratio_high: float = 5.0
    sequence_mask_low: float = 1e-5
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    # environment -> weight; empty here so that a preset's mix replaces, not extends, a default one
    env_mix: Dict[str, float] = field(default_factory=dict)
    engine: EngineKind = EngineKind.hf
    gen_batch_size: int = 64  # requests the hf engine generates together
    gen_threads: int = 1
    train_threads: int = 1
    micro_batch_size: int = 64
    bench_steps: int = 40  # steps of each run of `make bench-rl` (levels 0, 1, 2)
    pin_cores: bool = True  # hf engine on core 1, trainer on core 0: generation and training on separate cores
    # offline filter on rows' precomputed pass rate (the difficulty column of hub data); null = off
    max_pass_rate: Optional[float] = None
    # vllm engine (GPU presets)
    vllm_port: int = 8011
    vllm_gpu_memory_utilization: float = 0.5
    vllm_tensor_parallel_size: int = 1
    vllm_extra_args: List[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class BenchmarkConfig:
    """One benchmark of recipe/eval/benchmarks.py to run; null settings take the registry's (the paper's k) or,
    for sampling, eval.temperature / top_p / max_new_tokens."""

    name: str = ""
    samples: Optional[int] = None  # k of avg@k
    pass_k: Optional[List[int]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_new_tokens: Optional[int] = None
    max_problems: Optional[int] = None  # cap, for smoke runs
    # contest-date window (YYYY-MM-DD, both ends included) of benchmarks whose rows carry one (LiveCodeBench)
    contest_date_from: Optional[str] = None
    contest_date_to: Optional[str] = None


@dataclass
class EvalConfig:
    engine: EngineKind = EngineKind.hf
    checkpoints: List[str] = field(default_factory=lambda: ["base", "sft", "rl"])
    samples: int = 4  # k of avg@k
    pass_k: List[int] = field(default_factory=lambda: [1, 4])
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 96
    batch_size: int = 128
    max_problems_per_task: Optional[int] = None
    threads: int = 2
    seed: int = 1234
    held_out: bool = True  # the held-out suite of `make data` (false: benchmarks only)
    # the paper's benchmarks (recipe/eval/benchmarks.py), each with its own k and sampling settings
    benchmarks: List[BenchmarkConfig] = field(default_factory=list)
    benchmark_max_problems: Optional[int] = None  # cap for every benchmark without its own, for smoke runs
    hub_timeout_s: float = 10.0  # how long the hub may take to confirm a benchmark's pinned revision


@dataclass
class LauncherConfig:
    kind: LauncherKind = LauncherKind.local
    nodes: int = 1
    trainer_nodes: int = 1
    inference_nodes: int = 0
    judge_nodes: int = 0
    gpus_per_node: int = 0
    inference_tp: int = 1
    accelerate_config: Optional[str] = None
    partition: Optional[str] = None
    time_limit: str = "48:00:00"
    # true: the judge nodes are counted among inference_nodes (they serve the judge, not the policy)
    judge_in_inference: bool = False
    health_timeout_s: int = 3600  # the batch script waits this long for every vLLM server's /health


@dataclass
class Config:
    preset: str = "tiny"
    run_root: str = "runs"
    seed: int = 0
    force: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    base: TrainConfig = field(default_factory=TrainConfig)
    sft: TrainConfig = field(default_factory=TrainConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


ConfigStore.instance().store(name="schema", node=Config)


def validate(cfg) -> None:
    """Checks across keys (single values are typed by the schema)."""
    for key in ("rl.mask_ratio_low", "rl.temperature", "eval.samples", "rl.rollouts_per_example", "rl.batch_size"):
        if OmegaConf.select(cfg, key) <= 0:
            raise ConfigError(f"config error: {key} must be positive, got {OmegaConf.select(cfg, key)}")
    if any(w < 0 for w in cfg.rl.env_mix.values()) or sum(cfg.rl.env_mix.values()) <= 0:
        raise ConfigError(f"config error: rl.env_mix needs non-negative weights with a positive sum, "
                          f"got {dict(cfg.rl.env_mix)}")
    if cfg.eval.benchmark_max_problems is not None and cfg.eval.benchmark_max_problems <= 0:
        raise ConfigError(f"config error: eval.benchmark_max_problems must be positive, "
                          f"got {cfg.eval.benchmark_max_problems}")


def load_config(overrides: List[str] | None = None):
    """Compose configs/config.yaml with `key=value` overrides into a validated, read-only config."""
    overrides = list(overrides or [])
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except Exception as e:  # hydra and omegaconf raise several types; all mean "bad config"
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("full_key")]
        msg = "; ".join(lines[:2]) or type(e).__name__
        raise ConfigError(f"config error: {msg}") from None
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def config_hash(cfg, keys: List[str] | None = None) -> str:
    """sha256 of the resolved config (or of some of its sections), stable across runs."""
    data = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(data.get("data"), dict) and not data["data"].get("extra_tasks"):
        data["data"].pop("extra_tasks", None)  # added later: runs made before it keep their hash
    if keys is not None:
        data = {k: data[k] for k in keys}
    blob = json.dumps(data, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
