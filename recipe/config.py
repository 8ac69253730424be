"""Typed config schema and composition.

The hydra tree under configs/ is merged into these dataclasses, so a value of the wrong type or a choice outside
its Enum stops with an error that names it, before any stage does work. validate(), which load_config runs, is
the one place for every other check: keys the schema lacks (hydra's `+key=` and `++key=` add them to the typed
config), the valid range of every number (RANGES) and the checks that span keys. The paper's benchmarks are
checked against their registry by recipe.eval.benchmarks.validate_benchmarks, which the eval and plan stages
call. A dict given whole on the command line (`rl.env_mix={math:1.0}`) replaces the preset's (hydra would merge
the two).
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

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


class JudgePrompt(StrEnum):
    cot = "cot"  # CompassVerifier's CV_COT_PROMPT: analysis, then \\boxed{A/B/C} (prime-environments' i3-math)
    direct = "direct"  # CompassVerifier's CV_PROMPT: the letter alone (cheaper; CompassVerifier's own default)


class Staleness(StrEnum):
    """How the orchestrator bounds the age of what it trains on (recipe/rl/orchestrator.py, docs/recipe.md)."""

    drop_stale = "drop_stale"  # a finished group older than step - max_async_level is dropped
    prime_rl = "prime_rl"  # prime-rl's: a group in flight across more than max_off_policy_steps + 1 updates is
    # cancelled and replaced; finished groups are always used; no new group runs ahead of max_async_level


class OptimizerKind(StrEnum):
    adamw = "adamw"
    muon = "muon"


class LauncherKind(StrEnum):
    local = "local"
    slurm = "slurm"


class DType(StrEnum):
    """torch dtypes the model may be loaded in (the trainer's and the vLLM server's)."""
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class AttnImplementation(StrEnum):
    """transformers' attention implementations (attn_implementation=...)."""
    eager = "eager"
    sdpa = "sdpa"
    flash_attention_2 = "flash_attention_2"
    flash_attention_3 = "flash_attention_3"
    flex_attention = "flex_attention"


class SchedulerKind(StrEnum):
    """transformers' LR schedulers that need no arguments beyond warmup and steps (SchedulerType values)."""
    linear = "linear"
    cosine = "cosine"
    cosine_with_restarts = "cosine_with_restarts"
    polynomial = "polynomial"
    constant = "constant"
    constant_with_warmup = "constant_with_warmup"
    inverse_sqrt = "inverse_sqrt"


class ReportTo(StrEnum):
    """Where the stages' metrics go besides metrics.jsonl (recipe/tracking.py)."""
    none = "none"
    tensorboard = "tensorboard"
    wandb = "wandb"
    trackio = "trackio"


class CheckpointName(StrEnum):
    """The stages whose model eval can load (eval.checkpoints takes other models too: recipe.eval.models)."""
    base = "base"
    sft = "sft"
    rl = "rl"


HUB_PREFIX = "hub:"  # eval.checkpoints entry of a hub model: hub:<org>/<name>@<40-hex commit>
FULL_REVISION = re.compile(r"^[0-9a-f]{40}$")  # a hub repository's commit id: the only pin that cannot move
HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SAFE_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # a name that is also a results folder


@dataclass
class TinyArch:
    """Sizes of the locally built Glm4MoeForCausalLM (the GLM-4.5-Air architecture, scaled down)."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 3
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
class Glm4MoeArch(TinyArch):
    """A hub model's Glm4MoeForCausalLM architecture, the values of its config.json (model.arch). Only the
    launcher's plan reads it: it builds the model on the meta device to count parameters and the optimizer
    split; the stages load the hub's own config.json. The defaults are Glm4MoeConfig's (the tiny build's)."""

    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    use_qk_norm: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    rms_norm_eps: float = 1e-5
    num_nextn_predict_layers: int = 0  # the MTP layers: in the hub checkpoint, not built by transformers


@dataclass
class ModelConfig:
    name: str = "tiny-glm4moe"
    # hub_id None means the model is built and pretrained here by `make base` (tiny preset only).
    hub_id: Optional[str] = None
    revision: Optional[str] = None
    dtype: DType = DType.float32
    attn_implementation: AttnImplementation = AttnImplementation.sdpa
    tiny: TinyArch = field(default_factory=TinyArch)
    # a hub model's architecture, from which the launcher's plan counts parameters; null = not stated
    arch: Optional[Glm4MoeArch] = None
    # size in billions of parameters, for the plan of a model without model.arch; null = not stated (the tiny
    # model and a model with model.arch are counted from their architecture)
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
    # the offline difficulty filter, applied by `make data` alone (recipe.data.schema.too_easy): environment (RL
    # subset) -> threshold; a prompt of a listed environment whose precomputed pass rate is above it is dropped,
    # an environment not listed is not filtered, a row without a pass rate is kept. Hub data only (tiny rows
    # carry a task level in `difficulty`). INTELLECT-3: {math: 0.874}, code unfiltered
    max_pass_rate: Dict[str, float] = field(default_factory=dict)
    pass_rate_column: str = "avg@8_qwen3_4b_thinking_2507"


@dataclass
class TrainConfig:
    """Shared by the `base` (pretraining, tiny only) and `sft` stages; both run on TRL's SFTTrainer."""

    max_steps: int = 300
    batch_size: int = 32  # the global batch: each of launcher.num_processes ranks takes an even share of it
    grad_accum: int = 1
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    scheduler: SchedulerKind = SchedulerKind.cosine
    max_length: int = 256
    packing: bool = False
    # batches of rows of about equal length (recipe.sft.length_grouped_order): a random batch of the tiny chat rows
    # is about a third padding, a grouped one about 1%
    group_by_length: bool = False
    # rows laid end to end in one sequence, each with its own positions (recipe.sft.PackedBatchCollator): a step
    # trains the same rows as padded batches (1) with about 2% padding at 4; a rank's share of the batch must
    # divide by it
    rows_per_sequence: int = 1
    # chat rows: each prompt prefix that rows of a batch share computed once, in one flat pass
    # (recipe.sft.SharedPrefixCollator; sdpa attention, the plain-logits loss); supersedes rows_per_sequence
    shared_prefixes: bool = False
    bench_steps: int = 40  # steps of each run of `make bench-sft` (sft only)
    save_steps: int = 100
    save_total_limit: int = 2
    logging_steps: int = 10
    bf16: bool = False
    gradient_checkpointing: bool = False
    # TRL's fused LM head (log-probs in vocabulary tiles, never the whole logits: for a large vocabulary); false:
    # the same loss from the plain logits (recipe.sft.ResumingSFTTrainer.compute_loss), cheaper for a small one
    fused_lm_head: bool = True
    threads: int = 2
    # one process on CPU: fewer threads while other processes keep cores busy, `threads` at most (recipe.cores;
    # with one of 2 cores taken, 2 threads trained x3 slower than 1)
    adapt_threads: bool = True
    seed: int = 0


@dataclass
class JudgeConfig:
    """The LLM judge of the verifiers (INTELLECT-3: CompassVerifier-7B), served by a 1-node job of its own. With
    `enabled`, the math and science environments ask it about the answers their rules marked wrong
    (recipe/envs/judge.py); a judge that fails leaves the rule's verdict, and is counted."""
    hub_id: Optional[str] = None  # null: no judge job to launch
    revision: Optional[str] = None
    data_parallel: int = 8
    tensor_parallel: int = 1
    port: int = 8000
    enabled: bool = False  # the verifiers call the judge (RL only; eval grades by rules)
    url: Optional[str] = None  # the judge server's address; null: $RECIPE_JUDGE_URL, which the RL job exports
    prompt: JudgePrompt = JudgePrompt.cot
    max_tokens: int = 1024  # the judge's reply, at most (greedy); a cot reply cut short has no verdict
    timeout_s: float = 120.0  # one request
    tries: int = 3  # requests a verdict, the first included, while the judge is unreachable or times out
    cooldown_s: float = 30.0  # after a verdict that failed every try, the judge is not asked for this long


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
    decay_steps: int = 0  # > 0: the LR falls linearly over the run's last decay_steps steps, to lr * min_lr_share
    min_lr_share: float = 0.0
    weight_decay: float = 0.01
    # rl.optimizer=muon (recipe.rl.muon): momentum, and whether the update direction is the Nesterov one
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    # AdamW: the whole model (rl.optimizer=adamw) or Muon's AdamW group; torch's defaults here
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    max_async_level: int = 1
    max_off_policy_steps: int = 8
    staleness: Staleness = Staleness.drop_stale  # every preset sets prime_rl (configs/rl/*.yaml)
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
    micro_batch_size: int = 64  # samples a forward and backward pass of the trainer holds (memory, not the gradient)
    bench_steps: int = 40  # steps of each run of `make bench-rl` (levels 0, 1, 2)
    soak_steps: int = 200  # steps of `make soak` (RL with the memory of every process sampled)
    soak_sample_s: float = 1.0  # seconds between two memory samples of `make soak` (and of bench-trl's arms)
    pin_cores: bool = True  # hf engine on core 1, trainer on core 0: generation and training on separate cores
    # the RL processes' large torch buffers (trainer, hf engine) in transparent huge pages (recipe.runs.huge_pages):
    # less CPU, more RSS between steps; off in every preset
    huge_pages: bool = False
    # recompute each decoder layer's activations in the backward (prime-rl train.toml [model.ac] freq = 1): memory
    # for 51200-token samples at the cost of a second forward; off where memory is plenty (tiny)
    activation_checkpointing: bool = False
    # each distinct prompt's forward once a step for all its group's samples (recipe.rl.trainer.SharedPrompts:
    # the same gradient, fewer tokens). One trainer process without activation checkpointing; ranks and
    # activation checkpointing run every sample's prompt
    share_prompts: bool = True
    # online filter: drop groups whose rewards are all equal (no signal). prime-rl's production run had none
    # (its buffer filter is commented out at PR 1272): such groups stay in the batch with advantage 0
    online_filter: bool = True
    # difficulty pools (prime-rl's difficulty-pool buffer with easy_fraction = hard_fraction = 0): a prompt whose
    # group's mean reward came out above easy_border (below hard_border) is not drawn again, so that the engine
    # stops spending samples on what already has no signal. null: off (prime-rl's production run: the [buffer]
    # section of configs/int3/prod/orch.toml is commented out)
    easy_border: Optional[float] = None
    hard_border: Optional[float] = None
    # the offline pass-rate filter is data.max_pass_rate, applied by `make data`: RL trains on the rl split as is
    # prompt + completion of a sample never exceed this (prime-rl's seq_len): a request asks for at most
    # min(max_new_tokens, context - tokens so far) new tokens, the context being the least of the model's, the
    # server's and seq_len; a prompt that leaves no room is left out and counted. null: the model's context
    seq_len: Optional[int] = None
    # a sample the verifier could not judge (a sandbox or tool failure: MaskSample) leaves the loss and its group's
    # mean (true), or scores 0 like a wrong answer (false: prime-rl, which has no sample masking)
    mask_sandbox_failures: bool = True
    # the code environment runs at most this many of a problem's tests, the same ones every time (sampled with
    # the row's id as seed; prime-environments' i3-code: 15); null: every test. Eval runs every test
    code_max_tests: Optional[int] = 15
    # code reward: the share of tests passed (true: the tiny preset's choice, a gradient before whole programs pass)
    # or 1 only when all pass (false: prime-rl's i3-code)
    code_partial_credit: bool = True
    # vllm engine (GPU presets)
    vllm_port: int = 8011
    vllm_gpu_memory_utilization: float = 0.5
    vllm_tensor_parallel_size: int = 1
    vllm_extra_args: List[str] = field(default_factory=list)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    seed: int = 0
    # eval during RL (recipe/rl/eval_during.py): every eval_every steps (and at step 0 and the last step) rank 0
    # samples eval_samples completions a problem of eval_set through the RL's own engine, at the RL's sampling
    # settings, and appends avg@k and pass@k to <rl stage>/eval_during_rl.jsonl. 0 = off
    eval_every: int = 0
    eval_set: str = "held_out"  # held_out (eval.parquet of `make data`) or a benchmark of recipe/eval/benchmarks.py
    eval_samples: int = 4  # k
    eval_max_problems: Optional[int] = None  # the first this many (held_out: spread over the tasks); null = all


@dataclass
class BenchmarkConfig:
    """One benchmark of recipe/eval/benchmarks.py to run; null settings take the registry's (the release k) or,
    for sampling, eval.temperature / top_p / top_k / max_new_tokens, and where those are null too the model's
    generation_config.json (recipe/eval/sampling.py)."""

    name: str = ""
    samples: Optional[int] = None  # k of avg@k
    pass_k: Optional[List[int]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # -1: no top-k
    max_new_tokens: Optional[int] = None
    max_problems: Optional[int] = None  # cap, for smoke runs
    # contest-date window (YYYY-MM-DD, both ends included) of benchmarks whose rows carry one (LiveCodeBench)
    contest_date_from: Optional[str] = None
    contest_date_to: Optional[str] = None


@dataclass
class ReleasedModel:
    """A published model of the paper's table (the `intellect3` preset lists INTELLECT-3 and GLM-4.5-Air), for
    eval.checkpoints to name by `name`: its results folder, and the paper's row its scores are set beside."""

    name: str = ""  # as the paper's table names it (recipe.eval.report.PAPER_SCORES)
    hub_id: str = ""
    revision: Optional[str] = None  # a 40-hex commit of the hub repository
    # whether a primary source (the model's publisher, the paper, its code) names this revision as the one the
    # paper evaluated; false: a public pin from elsewhere. Either way the eval runs the revision and records
    # this flag and the source beside its scores, and RESULTS.md marks the row.
    revision_verified: bool = False
    revision_source: str = ""


@dataclass
class EvalConfig:
    engine: EngineKind = EngineKind.hf
    # the models to evaluate: base, sft, rl (this run's stages), a name of eval.released, hub:<org>/<name>@<commit>
    # (a hub model at a pinned revision) or a local model folder (a path with a /); recipe/eval/models.py
    checkpoints: List[str] = field(default_factory=lambda: ["base", "sft", "rl"])
    released: List[ReleasedModel] = field(default_factory=list)
    samples: int = 4  # k of avg@k
    pass_k: List[int] = field(default_factory=lambda: [1, 4])
    # sampling; null: the model folder's generation_config.json, else vLLM's neutral default (temperature and
    # top_p 1, no top-k), max_new_tokens whatever the context leaves (recipe/eval/sampling.py)
    temperature: Optional[float] = 1.0
    top_p: Optional[float] = 1.0
    top_k: Optional[int] = None  # -1: no top-k
    max_new_tokens: Optional[int] = 96
    batch_size: int = 128
    max_problems_per_task: Optional[int] = None
    threads: int = 2
    adapt_threads: bool = True  # the hf engine in this process: fewer threads while others keep cores busy (sft's)
    seed: int = 1234
    held_out: bool = True  # the held-out suite of `make data` (false: benchmarks only)
    # the paper's benchmarks (recipe/eval/benchmarks.py), each with its own k and sampling settings
    benchmarks: List[BenchmarkConfig] = field(default_factory=list)
    benchmark_max_problems: Optional[int] = None  # cap for every benchmark without its own, for smoke runs
    hub_timeout_s: float = 10.0  # how long the hub may take to confirm a benchmark's pinned revision


@dataclass
class LauncherConfig:
    kind: LauncherKind = LauncherKind.local
    # slurm: the RL job's nodes, trainer_nodes + inference_nodes exactly (the judge is a job of its own)
    nodes: int = 1
    trainer_nodes: int = 1
    inference_nodes: int = 0  # one policy server a node (vLLM; the hf stand-in on CPU)
    judge_nodes: int = 0  # the LLM judge's own job (rl.judge), beside the RL job
    gpus_per_node: int = 0  # 0: CPU nodes, launcher.num_processes trainer ranks a node
    inference_tp: int = 1
    accelerate_config: Optional[str] = None
    partition: Optional[str] = None
    time_limit: str = "48:00:00"
    health_timeout_s: int = 3600  # the batch script waits this long for every policy server's /health
    # trainer ranks `python -m recipe.rl` (and recipe.sft, recipe.base) starts on this machine (>1: it runs itself
    # under torchrun; in RL rank 0 also hosts the orchestrator and the engine client); on SLURM CPU nodes, the
    # ranks of each trainer node
    num_processes: int = 1
    # how long a rank waits in one collective (e.g. for rank 0 to gather a step's rollouts) before it fails;
    # a rank that dies is noticed at once (torchrun stops the others), this bounds a rank that hangs
    collective_timeout_s: int = 1800
    # FSDP2 as HSDP: the trainer ranks form this many replicas, each sharding the model over its ranks
    # (prime-rl's --model.dp-replicate); 1: plain full sharding over every rank
    hsdp_replicas: int = 1
    master_port: int = 29500  # the trainer ranks' rendezvous on the first trainer node (SLURM)
    # the eval job (`make plan`: eval.sbatch): its nodes, one vLLM server a node (TP launcher.inference_tp, data
    # parallel over the node's other GPUs), the eval client on the first; the plan's hours divide by
    # eval_server_tokens_per_s (completion tokens a second of one server, all its requests together) and take the
    # mean completion as eval_completion_share of max_new_tokens where no results.json of the preset measured it.
    # null: no hours, no expected tokens
    eval_nodes: int = 1
    eval_server_tokens_per_s: Optional[float] = None
    eval_completion_share: Optional[float] = None


@dataclass
class LoggingConfig:
    """Experiment tracking for every stage (recipe/tracking.py). Not in any stage's config hash: where metrics are
    also sent does not change a stage's output, so switching it neither redoes nor refuses a finished stage."""
    report_to: ReportTo = ReportTo.none
    project: str = "intellect3-recipe"  # the wandb and trackio project; each stage is a run <preset>-<stage> in it


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
    logging: LoggingConfig = field(default_factory=LoggingConfig)


ConfigStore.instance().store(name="schema", node=Config)


# -- valid ranges ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """An interval of valid values: low/high None = unbounded; open ends excluded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, v) -> bool:
        return ((self.low is None or (v > self.low if self.low_open else v >= self.low))
                and (self.high is None or (v < self.high if self.high_open else v <= self.high)))

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


AT_LEAST_0, AT_LEAST_1, POSITIVE = Range(0), Range(1), Range(0, low_open=True)
SHARE, SHARE_OPEN = Range(0, 1), Range(0, 1, low_open=True)  # [0, 1]; (0, 1]

TINY_ARCH_RANGES: dict[str, Range] = {
    "vocab_size": AT_LEAST_1,
    "hidden_size": AT_LEAST_1,
    "intermediate_size": AT_LEAST_1,
    "num_hidden_layers": AT_LEAST_1,
    "num_attention_heads": AT_LEAST_1,
    "num_key_value_heads": AT_LEAST_1,
    "head_dim": AT_LEAST_1,
    "moe_intermediate_size": AT_LEAST_1,
    "n_routed_experts": AT_LEAST_1,
    "num_experts_per_tok": AT_LEAST_1,
    "n_shared_experts": AT_LEAST_0,
    "first_k_dense_replace": AT_LEAST_0,
    "partial_rotary_factor": SHARE_OPEN,
    "rope_theta": POSITIVE,
    "max_position_embeddings": AT_LEAST_1,
}
ARCH_RANGES: dict[str, Range] = {  # the fields Glm4MoeArch adds
    "routed_scaling_factor": POSITIVE,
    "n_group": AT_LEAST_1,
    "topk_group": AT_LEAST_1,
    "rms_norm_eps": POSITIVE,
    "num_nextn_predict_layers": AT_LEAST_0,
}

# The valid range of every int and float of the schema (a test checks that none is missing). Optional fields
# are checked when set (null means off / the default). `[]` stands for every item of a list.
# Checks that span keys (contexts, pass_k against samples, the tiny architecture) are in validate() below.
RANGES: dict[str, Range] = {
    "seed": AT_LEAST_0,
    # the architectures: the tiny one (built by `make base`) and a hub model's (counted by the plan)
    **{f"model.tiny.{k}": r for k, r in TINY_ARCH_RANGES.items()},
    **{f"model.arch.{k}": r for k, r in {**TINY_ARCH_RANGES, **ARCH_RANGES}.items()},
    "model.params_total_b": POSITIVE,
    "model.params_active_b": POSITIVE,
    # data
    "data.seed": AT_LEAST_0,
    "data.sft_rows_per_task": AT_LEAST_1,
    "data.rl_rows_per_task": AT_LEAST_1,
    "data.eval_rows_per_task": AT_LEAST_1,
    "data.pretrain_rows_per_task": AT_LEAST_0,  # 0 for hub models; `make base` refuses an empty pretrain split
    "data.no_think_fraction": SHARE,
    "data.tool_hasty_fraction": SHARE,
    "data.tasks[].difficulty": AT_LEAST_0,
    "data.extra_tasks[].difficulty": AT_LEAST_0,
    "data.max_rows": AT_LEAST_1,
    "data.hub_timeout_s": POSITIVE,
    "data.max_pass_rate": SHARE,  # each environment's threshold
    # base and sft (TRL's SFTTrainer: max_steps -1 would mean "whole epochs", so steps are >= 1 here)
    **{f"{t}.{k}": r for t in ("base", "sft") for k, r in {
        "max_steps": AT_LEAST_1, "batch_size": AT_LEAST_1, "grad_accum": AT_LEAST_1, "lr": POSITIVE,
        "weight_decay": AT_LEAST_0, "warmup_ratio": SHARE, "max_length": AT_LEAST_1, "save_steps": AT_LEAST_1,
        "save_total_limit": AT_LEAST_1, "logging_steps": AT_LEAST_1, "threads": AT_LEAST_1,
        "rows_per_sequence": AT_LEAST_1, "bench_steps": AT_LEAST_1, "seed": AT_LEAST_0}.items()},
    # rl
    "rl.max_steps": AT_LEAST_1,
    "rl.batch_size": AT_LEAST_1,
    "rl.rollouts_per_example": Range(2),  # one rollout a prompt has no group to compare with: every group is flat
    "rl.max_new_tokens": AT_LEAST_1,
    "rl.easy_border": SHARE,  # rewards are shares of 1 (code's partial credit too)
    "rl.hard_border": SHARE,
    "rl.temperature": POSITIVE,  # the trainer divides the logits by it; no greedy RL
    "rl.lr": POSITIVE,
    "rl.warmup_steps": AT_LEAST_0,
    "rl.decay_steps": AT_LEAST_0,
    "rl.min_lr_share": SHARE,
    "rl.weight_decay": AT_LEAST_0,
    "rl.muon_momentum": Range(0, 1, high_open=True),
    "rl.adam_beta1": Range(0, 1, high_open=True),
    "rl.adam_beta2": Range(0, 1, high_open=True),
    "rl.adam_eps": POSITIVE,
    "rl.max_grad_norm": POSITIVE,
    "rl.max_async_level": AT_LEAST_0,  # 0: the synchronous baseline
    "rl.max_off_policy_steps": AT_LEAST_0,
    "rl.mask_ratio_low": Range(0, 1, low_open=True, high_open=True),
    "rl.mask_ratio_high": Range(1, low_open=True),
    "rl.sequence_mask_low": Range(0, 1, high_open=True),
    "rl.checkpoint_every": AT_LEAST_1,
    "rl.keep_checkpoints": AT_LEAST_1,
    "rl.env_mix": AT_LEAST_0,  # each weight; their sum must be positive (validate)
    "rl.gen_batch_size": AT_LEAST_1,
    "rl.gen_threads": AT_LEAST_1,
    "rl.train_threads": AT_LEAST_1,
    "rl.micro_batch_size": AT_LEAST_1,
    "rl.bench_steps": AT_LEAST_1,
    "rl.soak_steps": AT_LEAST_1,
    "rl.soak_sample_s": POSITIVE,
    "rl.seq_len": AT_LEAST_1,
    "rl.code_max_tests": AT_LEAST_1,
    "rl.vllm_port": Range(1, 65535),
    "rl.vllm_gpu_memory_utilization": SHARE_OPEN,
    "rl.vllm_tensor_parallel_size": AT_LEAST_1,
    "rl.seed": AT_LEAST_0,
    "rl.eval_every": AT_LEAST_0,  # 0: off
    "rl.eval_samples": AT_LEAST_1,
    "rl.eval_max_problems": AT_LEAST_1,
    # eval (0 temperature = greedy)
    "eval.samples": AT_LEAST_1,
    "eval.pass_k": AT_LEAST_1,  # each k; at most eval.samples (validate)
    "eval.temperature": AT_LEAST_0,
    "eval.top_p": SHARE_OPEN,
    "eval.top_k": Range(-1),  # -1 (or 0): no top-k
    "eval.max_new_tokens": AT_LEAST_1,
    "eval.batch_size": AT_LEAST_1,
    "eval.max_problems_per_task": AT_LEAST_1,
    "eval.threads": AT_LEAST_1,
    "eval.seed": AT_LEAST_0,
    "eval.benchmark_max_problems": AT_LEAST_1,
    "eval.hub_timeout_s": POSITIVE,
    # each benchmark's own settings (null: the registry's or eval's); pass_k against the registry's samples
    # is checked by recipe.eval.benchmarks.validate_benchmarks
    "eval.benchmarks[].samples": AT_LEAST_1,
    "eval.benchmarks[].pass_k": AT_LEAST_1,
    "eval.benchmarks[].temperature": AT_LEAST_0,
    "eval.benchmarks[].top_p": SHARE_OPEN,
    "eval.benchmarks[].top_k": Range(-1),
    "eval.benchmarks[].max_new_tokens": AT_LEAST_1,
    "eval.benchmarks[].max_problems": AT_LEAST_1,
    # launcher (the SLURM placement is checked by recipe.launch)
    "launcher.nodes": AT_LEAST_1,
    "launcher.trainer_nodes": AT_LEAST_1,
    "launcher.inference_nodes": AT_LEAST_0,
    "launcher.judge_nodes": AT_LEAST_0,
    "launcher.gpus_per_node": AT_LEAST_0,
    "launcher.inference_tp": AT_LEAST_1,
    "launcher.health_timeout_s": AT_LEAST_1,
    "launcher.num_processes": AT_LEAST_1,
    "launcher.collective_timeout_s": AT_LEAST_1,
    "launcher.hsdp_replicas": AT_LEAST_1,
    "launcher.eval_nodes": AT_LEAST_1,
    "launcher.eval_server_tokens_per_s": POSITIVE,
    "launcher.eval_completion_share": SHARE_OPEN,
    "launcher.master_port": AT_LEAST_1,
    "rl.judge.data_parallel": AT_LEAST_1,
    "rl.judge.tensor_parallel": AT_LEAST_1,
    "rl.judge.port": AT_LEAST_1,
    "rl.judge.max_tokens": AT_LEAST_1,
    "rl.judge.timeout_s": POSITIVE,
    "rl.judge.tries": AT_LEAST_1,
    "rl.judge.cooldown_s": AT_LEAST_0,
}


def _fail(msg: str):
    raise ConfigError(f"config error: {msg}")


def _numbers(node, path: str = ""):
    """(key, value) of every int and float in the tree: list items as key[i], dict and list values each."""
    if isinstance(node, (DictConfig, ListConfig)):
        items = node.items_ex(resolve=True) if isinstance(node, DictConfig) else enumerate(node)
        for k, v in items:
            if isinstance(node, ListConfig):
                key = f"{path}[{k}]"
            else:
                key = f"{path}.{k}" if path else str(k)
            yield from _numbers(v, key)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, node


def _pattern(key: str) -> str:
    """rl.env_mix.math -> rl.env_mix; data.tasks[3].difficulty -> data.tasks[].difficulty; eval.pass_k[0] ->
    eval.pass_k: the RANGES entry a value falls under."""
    key = re.sub(r"\[\d+\](?=.)", "[]", key)
    key = re.sub(r"\[\d+\]$", "", key)
    for dict_field in DICT_FIELDS:
        if key.startswith(dict_field + "."):
            return dict_field
    return key


def _check_ranges(cfg) -> None:
    for key, value in _numbers(cfg):
        pattern = _pattern(key)
        if pattern.endswith("[].params"):
            continue  # a tiny task's generator arguments (data.tasks[].params): the generator takes or refuses them
        rng = RANGES.get(pattern)
        if rng is None:
            raise KeyError(f"recipe/config.py: RANGES has no entry for {pattern}")  # a schema field added without one
        if value not in rng:
            kind = "an integer" if isinstance(value, int) else "a number"
            _fail(f"{key} must be {kind} {rng}, got {value}")


# -- keys the schema does not have ---------------------------------------------------------------------------
def _field_types(tp) -> dict:
    """name -> the dataclass a field holds (a list's item type for List[...]), dict for Dict[...], else None."""
    out = {}
    for name, t in typing.get_type_hints(tp).items():
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin in (list, List) and args and dataclasses.is_dataclass(args[0]):
            t = args[0]
        out[name] = t if dataclasses.is_dataclass(t) else dict if origin in (dict, Dict) else None
    return out


def _dict_fields(tp=None, prefix: str = "") -> set[str]:
    """Dotted keys of the schema fields typed Dict[...], whose keys are free (e.g. rl.env_mix)."""
    out = set()
    hints = typing.get_type_hints(tp or Config)
    for name, t in _field_types(tp or Config).items():
        if t is dict:
            out.add(prefix + name)
        elif t is not None:
            is_list = typing.get_origin(hints[name]) in (list, List)
            out |= _dict_fields(t, f"{prefix}{name}{'[]' if is_list else ''}.")
    return out


DICT_FIELDS = _dict_fields()


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


# keys that were moved, and where to
MOVED = {"rl.max_pass_rate": "the pass-rate filter is data.max_pass_rate={<environment>: <rate>}, applied by "
                             "`make data`"}


def unknown_key_message(key: str) -> str:
    """What to say about a key the schema does not have (typed on the command line, added with + or ++, or in a
    config file). Keys under a dict field (rl.env_mix.<env>) are free and never land here."""
    parent, _, name = key.rpartition(".")
    tp = Config
    for part in [p for p in re.sub(r"\[\d*\]", "", parent).split(".") if p]:
        inner = _field_types(tp).get(part)
        if not dataclasses.is_dataclass(inner):
            break
        tp = inner
    known = [f.name for f in dataclasses.fields(tp)]
    where = f"{parent} ({tp.__name__})" if parent else "the top level"
    if key in MOVED:
        return f"unknown key {key}: {where} has no key '{name}'; {MOVED[key]}"
    return f"unknown key {key}: {where} has no key '{name}'{_suggest(name, known)}"


def _check_keys(node, path: str = "") -> None:
    """Every key in the tree is a schema field: hydra's `+key=value` and `++key=value` add keys to the typed
    config (it opens the struct flag to do so), which the merge into the schema would otherwise keep."""
    if isinstance(node, (DictConfig, ListConfig)) and node._is_none():  # an Optional container set to null
        return
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            _check_keys(item, f"{path}[{i}]")
        return
    if not isinstance(node, DictConfig):
        return
    tp = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(tp):
        fields = {f.name for f in dataclasses.fields(tp)}
        for k in node.keys():
            if k not in fields:
                _fail(unknown_key_message(f"{path}.{k}" if path else str(k)))
    for k, child in node.items_ex(resolve=False):
        _check_keys(child, f"{path}.{k}" if path else str(k))


# -- checks that span keys -------------------------------------------------------------------------------------
def validate(cfg) -> None:
    """Every check of the composed config: keys the schema has, values that resolve, the valid range of each
    number (RANGES), and the checks that span keys. load_config runs it; the stages see only valid configs."""
    _check_keys(cfg)
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:  # ${...} that points nowhere
        _fail(f"{getattr(e, 'full_key', '') or 'a value'} does not resolve: {str(e).splitlines()[0]}")
    _check_ranges(cfg)

    if sum(cfg.rl.env_mix.values()) <= 0:
        _fail(f"rl.env_mix needs non-negative weights with a positive sum, got {dict(cfg.rl.env_mix)}")
    bad_k = [k for k in cfg.eval.pass_k if k > cfg.eval.samples]
    if bad_k:
        _fail(f"eval.pass_k={list(cfg.eval.pass_k)} must lie in 1..eval.samples ({cfg.eval.samples}): "
              f"pass@k needs k samples a problem")
    if cfg.rl.warmup_steps + cfg.rl.decay_steps > cfg.rl.max_steps:
        _fail(f"rl.warmup_steps ({cfg.rl.warmup_steps}) + rl.decay_steps ({cfg.rl.decay_steps}) must be <= "
              f"rl.max_steps ({cfg.rl.max_steps}): the decay takes the run's last steps, after the warmup")
    if cfg.rl.max_off_policy_steps < cfg.rl.max_async_level:
        _fail(f"rl.max_off_policy_steps ({cfg.rl.max_off_policy_steps}) must be >= rl.max_async_level "
              f"({cfg.rl.max_async_level}): the engine would cancel requests the trainer may still take")
    judge_url = cfg.rl.judge.url
    if judge_url is not None and not re.match(r"https?://[^/\s]+", judge_url):
        _fail(f"rl.judge.url must be an http(s) address (http://host:port), got {judge_url!r}")
    for key in ("base", "sft"):
        if cfg[key].group_by_length and cfg[key].packing:
            _fail(f"{key}.group_by_length and {key}.packing exclude each other: packed rows have no padding to save")
        if cfg[key].shared_prefixes and (cfg[key].packing or cfg[key].fused_lm_head):
            _fail(f"{key}.shared_prefixes lays each batch out itself and scores it from the plain logits: it "
                  f"excludes {key}.packing and needs {key}.fused_lm_head=false")
        rows = cfg[key].rows_per_sequence
        if rows > 1 and (cfg[key].packing or cfg[key].group_by_length):
            _fail(f"{key}.rows_per_sequence={rows} packs each batch itself: it excludes {key}.packing and "
                  f"{key}.group_by_length")
    _check_pass_rate_filter(cfg.data)
    _check_eval_models(cfg.eval)
    m = cfg.model
    if m.params_total_b is not None and m.params_active_b is not None and m.params_active_b > m.params_total_b:
        _fail(f"model.params_active_b ({m.params_active_b}) must be <= model.params_total_b ({m.params_total_b})")

    if m.arch is not None:
        _check_arch(m.arch, "model.arch")
    if m.hub_id is None:  # the tiny model of `make base`: its architecture and context are known here
        arch = m.tiny
        _check_arch(arch, "model.tiny")
        ctx = arch.max_position_embeddings
        # a completion needs room for its prompt: the tiny prompts are tens of tokens
        for key in ("rl.max_new_tokens", "eval.max_new_tokens"):
            value = OmegaConf.select(cfg, key)
            if value is not None and value + MIN_PROMPT_TOKENS > ctx:
                _fail(f"{key} ({value}) plus a prompt ({MIN_PROMPT_TOKENS} tokens or more) must fit the model's "
                      f"context, model.tiny.max_position_embeddings ({ctx})")
        for key in ("base.max_length", "sft.max_length"):
            value = OmegaConf.select(cfg, key)
            if value > ctx:
                _fail(f"{key} ({value}) must be <= the model's context, model.tiny.max_position_embeddings ({ctx})")
    # A hub model's context (max_position_embeddings in its config.json) is known only once its files are in
    # hand, so it is not checked here: vLLM refuses a max_tokens beyond max_model_len when it serves the model,
    # and TRL truncates SFT rows to sft.max_length.


MIN_PROMPT_TOKENS = 16  # no tiny prompt is shorter (the instruction alone is longer)


def _check_pass_rate_filter(data) -> None:
    """data.max_pass_rate names environments of the hub's RL subsets: a typo would filter nothing, and the tiny
    rows have no pass rate to filter on."""
    limits = dict(data.max_pass_rate)
    if not limits:
        return
    if data.source != DataSource.intellect3:
        _fail(f"data.max_pass_rate={limits}: the {data.source} rows carry no pass rate to filter on (their "
              f"difficulty is a task level); the filter is for hub data (data.source=intellect3)")
    unknown = sorted(set(limits) - set(data.rl_dataset.subsets))
    if unknown:
        _fail(f"data.max_pass_rate names {unknown}, not among the RL subsets data.rl_dataset.subsets "
              f"({list(data.rl_dataset.subsets)}){_suggest(unknown[0], data.rl_dataset.subsets)}")


def checkpoint_entry(entry: str, released_names) -> tuple[str, str | None, str | None]:
    """(kind, hub id, revision) of one eval.checkpoints entry: kind `stage` (base, sft, rl), `released` (a name
    of eval.released), `hub` (hub:<org>/<name>@<commit>) or `local` (a path with a /: a model folder, looked for
    when the eval starts). A ValueError says what is wrong with anything else."""
    if entry in CheckpointName.__members__:
        return "stage", None, None
    if entry in released_names:
        return "released", None, None
    if entry.startswith(HUB_PREFIX):
        ref = entry[len(HUB_PREFIX):]
        repo, at, revision = ref.partition("@")
        if not HUB_REPO.match(repo):
            raise ValueError(f"'{repo}' is not a hub repository id (<org>/<name>)")
        if not at or not revision:
            raise ValueError(f"hub model {repo} has no revision: every hub reference is pinned, "
                             f"hub:{repo}@<40-hex commit>")
        if not FULL_REVISION.match(revision):
            raise ValueError(f"revision '{revision}' of {repo} is not a full commit id (40 hex digits): a branch or "
                             f"tag can move")
        return "hub", repo, revision
    if "/" in entry or entry.startswith((".", "~")):
        return "local", None, None
    known = ", ".join(released_names) or "none in this preset"
    raise ValueError(f"is not a checkpoint: base, sft, rl, a released model of eval.released ({known}), "
                     f"hub:<org>/<name>@<40-hex commit> or a model folder (a path with a /)")


def _check_eval_models(ev) -> None:
    """eval.released: names that are results folders, pinned hub ids; eval.checkpoints: entries of a known kind,
    each once (a hub reference without its revision is refused here, before any work)."""
    names = []
    for i, m in enumerate(ev.released):
        key = f"eval.released[{i}]"
        if not SAFE_NAME.match(m.name) or m.name in CheckpointName.__members__:
            _fail(f"{key}.name={m.name!r} must be a folder name (letters, digits, . _ -) other than base, sft, rl")
        if m.name in names:
            _fail(f"{key}.name={m.name!r} is listed twice")
        names.append(m.name)
        if not HUB_REPO.match(m.hub_id):
            _fail(f"{key}.hub_id={m.hub_id!r} is not a hub repository id (<org>/<name>)")
        if m.revision is not None and not FULL_REVISION.match(m.revision):
            _fail(f"{key}.revision={m.revision!r} of {m.hub_id} is not a full commit id (40 hex digits)")
    seen = set()
    for i, entry in enumerate(ev.checkpoints):
        key = f"eval.checkpoints[{i}]={entry!r}"
        try:
            kind, _, _ = checkpoint_entry(entry, names)
        except ValueError as e:
            _fail(f"{key} {e}" if str(e).startswith("is not") else f"{key}: {e}")
        if kind == "released" and ev.released[names.index(entry)].revision is None:
            _fail(f"{key}: eval.released names {ev.released[names.index(entry)].hub_id} without a revision; pin it "
                  f"(eval.released[{names.index(entry)}].revision) or write hub:<org>/<name>@<40-hex commit>")
        if entry in seen:
            _fail(f"{key} is listed twice")
        seen.add(entry)


def _check_arch(arch, key: str) -> None:
    """Sizes that do not make a working Glm4MoeForCausalLM."""
    if arch.num_attention_heads % arch.num_key_value_heads:
        _fail(f"{key}.num_attention_heads ({arch.num_attention_heads}) must be a multiple of "
              f"{key}.num_key_value_heads ({arch.num_key_value_heads})")
    if arch.num_experts_per_tok > arch.n_routed_experts:
        _fail(f"{key}.num_experts_per_tok ({arch.num_experts_per_tok}) must be <= "
              f"{key}.n_routed_experts ({arch.n_routed_experts})")
    if arch.first_k_dense_replace > arch.num_hidden_layers:
        _fail(f"{key}.first_k_dense_replace ({arch.first_k_dense_replace}) must be <= "
              f"{key}.num_hidden_layers ({arch.num_hidden_layers})")


# -- composition -------------------------------------------------------------------------------------------
def _compose(overrides: List[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _replacing_dicts(overrides: List[str]) -> tuple[List[str], dict]:
    """A dict given whole for a dict field (`rl.env_mix={math:1.0}`) replaces the preset's, where hydra would
    merge the two: each key the field has at that point and the dict lacks is deleted first (`~rl.env_mix.logic`,
    which hydra does take). Group choices (`preset=...`, `rl=...`) apply before any value, as in hydra."""
    parser, parsed = OverridesParser.create(), []
    for line in overrides:
        try:
            parsed.append(parser.parse_overrides([line])[0])
        except Exception:  # a bad override: compose reports it
            parsed.append(None)
    groups = [line for line, ov in zip(overrides, parsed)
              if ov is not None and "." not in ov.key_or_group and (CONFIG_DIR / ov.key_or_group).is_dir()]
    out: List[str] = []
    typed = {}  # override as rewritten -> as the user typed it (for error messages)
    for line, ov in zip(overrides, parsed):
        if (ov is not None and ov.key_or_group in DICT_FIELDS and isinstance(ov.value(), dict)
                and ov.type in (OverrideType.CHANGE, OverrideType.FORCE_ADD)):
            current = OmegaConf.select(_compose(groups + [o for o in out if o not in groups]), ov.key_or_group)
            out += [f"~{ov.key_or_group}.{k}" for k in current if k not in ov.value()]
            rewritten = f"++{ov.key_or_group}={line.split('=', 1)[1]}"  # ++: the dict may bring new keys
            typed[rewritten], line = line, rewritten
        out.append(line)
    return out, typed


def _composition_error(e: Exception) -> str:
    """hydra's and omegaconf's errors, as one line that names the key or file."""
    text = str(e)
    if "Unexpected type for root: NoneType" in text or "'NoneType' object has no attribute 'get'" in text:
        # omegaconf cannot set keys of a block that is null: model.arch, the one Optional block, in a preset
        # whose model states no architecture
        return ("model.arch is null in this preset: its keys cannot be set from the command line; select a model "
                "config that states it (model=glm45_air) or write the block in a config file")
    m = re.match(r"In '[^']*': Could not find '([^']+)/([^']+)'", text)
    if m:
        group, name = m.groups()
        options = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
        return (f"{group}={name}: there is no configs/{group}/{name}.yaml (known: {', '.join(options)})"
                f"{_suggest(name, options)}")
    cause = e.__cause__
    override = re.search(r"(?:override|overriding) '?(\S+?)'?\.?$", text.splitlines()[0])
    line = override.group(1) if override else None
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        key = getattr(cause, "full_key", "") or ""
        target = line.split("=")[0].lstrip("+~") if line else ""
        if target and key != target and not key.startswith(target + "."):
            key = f"{target}[].{key}"  # a key inside a list item: omegaconf names it alone (data.tasks=[{tsk:1}])
        if any(key.startswith(d + ".") for d in DICT_FIELDS):
            field_name, _, entry = key.rpartition(".")
            return (f"{field_name} has no entry '{entry}' to change: add one with +{key}=<value>, or give the "
                    f"whole {field_name}={{...}}, which replaces it")
        return unknown_key_message(key)
    if cause is not None:
        detail = str(cause).splitlines()[0]
        where = text.split("override", 1)[-1].strip() if "override" in text else getattr(cause, "full_key", "")
        return f"{where}: {detail}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("full_key", "Config search",
                                                                                         "\tprovider"))]
    return "; ".join(lines[:2]) or type(e).__name__


def load_config(overrides: List[str] | None = None):
    """Compose configs/config.yaml with `key=value` overrides into a validated, read-only config."""
    overrides = list(overrides or [])
    typed: dict = {}
    try:
        lines, typed = _replacing_dicts(overrides)
        cfg = _compose(lines)
    except Exception as e:  # hydra and omegaconf raise several types; all mean "bad config"
        msg = _composition_error(e)
        for rewritten, line in typed.items():
            msg = msg.replace(rewritten, line)
        raise ConfigError(f"config error: {msg}") from None
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def drop_unset_top_k(ev) -> None:
    """eval.top_k and eval.benchmarks[].top_k, when null, out of a config container (in place): added later, so
    that runs made before them keep their hashes and keys."""
    if not isinstance(ev, dict):
        return
    if ev.get("top_k", 0) is None:
        ev.pop("top_k")
    for b in ev.get("benchmarks") or []:
        if isinstance(b, dict) and b.get("top_k", 0) is None:
            b.pop("top_k")


# keys that decide how fast a stage runs, not what it computes (recipe.cores: the same steps and samples, up to
# float rounding between thread counts): out of every hash of base, sft and eval, and of the held-out eval's key
SPEED_KEYS = ("adapt_threads",)


def config_hash(cfg, keys: List[str] | None = None) -> str:
    """sha256 of the resolved config (or of some of its sections), stable across runs."""
    data = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(data.get("data"), dict) and not data["data"].get("extra_tasks"):
        data["data"].pop("extra_tasks", None)  # added later: runs made before it keep their hash
    if isinstance(data.get("data"), dict) and data["data"].get("source") != "intellect3" \
            and data["data"].get("max_pass_rate") == {}:
        # the tiny build never read data.max_pass_rate, a float that defaulted to 0.874 before it became a dict
        # per environment: tiny data made before keeps its hash (and with it base and sft)
        data["data"]["max_pass_rate"] = 0.874
    if isinstance(data.get("model"), dict):
        data["model"].pop("arch", None)  # read by the launcher's plan alone: no stage's output depends on it
    drop_unset_top_k(data.get("eval"))
    for key in ("base", "sft", "eval"):
        for speed in SPEED_KEYS if isinstance(data.get(key), dict) else ():
            data[key].pop(speed, None)
    for key in ("base", "sft"):
        if isinstance(data.get(key), dict):
            data[key].pop("bench_steps", None)  # read by `make bench-sft` alone
            if data[key].get("rows_per_sequence") == 1:
                data[key].pop("rows_per_sequence")  # one row a sequence, as before the field: the hash stays
            if data[key].get("fused_lm_head") is True:
                data[key].pop("fused_lm_head")  # TRL's head, as before the field: the hash stays
            if data[key].get("shared_prefixes") is False:
                data[key].pop("shared_prefixes")  # every row computed whole, as before the field: the hash stays
    if keys is not None:
        data = {k: data[k] for k in keys}
    blob = json.dumps(data, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
