"""Supervised training on TRL's SFTTrainer, shared by `make base` (plain text) and `make sft` (chat data).

TRL does the work: loss masking, packing when asked, checkpoints. This module adds what the recipe needs
around it: resume from the last checkpoint, metrics.jsonl, a final model folder in Hugging Face format, and
chat rows tokenized here (`chat_dataset`) so that a tool-use demonstration leaves the environment's reply out
of the loss, as RL does.

On several ranks (torchrun; recipe.sft.__main__ and recipe.base start them) every rank runs the same Trainer,
which takes the process group from the environment: DDP over gloo on CPU, FSDP2 over the GPUs (`sharding`). The
configured batch_size is the global batch: each rank takes batch_size / ranks of it, so a step sees the same
examples at any number of ranks. Rank 0 alone writes metrics.jsonl and the final folder, and alone removes a
damaged checkpoint; the ranks agree on a stop request, so all of them stop, and save, after the same step.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PreTrainedModel, TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.data_utils import common_prefix_length

from recipe.chat import ENV_REPLY, messages, template_tools
from recipe.cores import ThreadGovernor
from recipe.errors import ConfigError, DataError, StageError
from recipe.model.attention import SDPA_GQA, SDPA_ROWS, SDPA_TREE, TreeRows
from recipe.rl.dist import World
from recipe.runs import STOP, MetricsLog, safetensors_problem, torch_save_problem
from recipe.tracking import TrainerTracking


class MetricsCallback(TrainerCallback):
    """Trainer logs -> metrics.jsonl (one process writes it: the Trainer's logs already hold every rank's mean)."""

    def __init__(self, metrics: MetricsLog):
        self.metrics = metrics
        self.started = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            # seconds since this process began training (a resumed run starts again from 0): step times
            elapsed = {"elapsed_s": time.perf_counter() - self.started} if self.started is not None else {}
            self.metrics.log({"step": state.global_step, **elapsed, **{k: v for k, v in logs.items()
                                                                        if isinstance(v, (int, float))},
                              "threads": torch.get_num_threads()})


class ThreadsCallback(TrainerCallback):
    """torch's threads follow the cores other processes leave free (recipe.cores.ThreadGovernor), checked at the
    end of a step; each change is one line on stdout, and metrics.jsonl records the threads of every logged step."""

    def __init__(self, governor: ThreadGovernor, key: str):
        self.governor, self.key = governor, key

    def on_step_end(self, args, state, control, **kwargs):
        threads = self.governor.step()
        if threads is not None:
            print(f"{self.key}: step {state.global_step}: {self.governor.describe()}", flush=True)


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None when it is intact.

    Checked from sizes and headers, not by loading: a safetensors file must be exactly as long as its header says
    (8-byte length, JSON header, then the data its offsets end at), a torch.save file (optimizer.pt, scheduler.pt,
    rng_state.pth, training_args.bin) must open as a zip, whose central directory sits at the very end of the file,
    and trainer_state.json must parse. That catches every truncated or missing file, which is what a kill, a full
    disk or a lost page cache leaves, and costs a few reads however large the model; loading the optimizer state
    here would read it twice (the Trainer loads it again). A file torn in the middle with its length intact is not
    caught.

    A checkpoint of FSDP2 ranks (SHARDED_STATE_DICT) holds the model and the optimizer as torch.distributed.checkpoint
    folders instead (FSDP_FOLDERS): each must have its .metadata, which the save writes after every rank's shard,
    and every shard file that names, at least as long as the metadata says."""
    try:
        json.loads((ckpt / "trainer_state.json").read_text())["global_step"]
    except FileNotFoundError:
        return "trainer_state.json is missing (the save was cut short)"
    except (ValueError, KeyError) as e:
        return f"trainer_state.json does not parse ({e})"
    if (ckpt / FSDP_FOLDERS[0]).is_dir():
        for name in FSDP_FOLDERS:
            if problem := dcp_problem(ckpt / name):
                return problem
        if not (ckpt / "scheduler.pt").exists():
            return "scheduler.pt is missing"
        for p in sorted([*ckpt.glob("*.pt"), *ckpt.glob("*.pth"), *ckpt.glob("*.bin")]):
            if problem := torch_save_problem(p):
                return problem
        return None
    weights = sorted(ckpt.glob("*.safetensors"))
    if not weights:
        return "no model weights (*.safetensors)"
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        try:
            missing = set(json.loads(index.read_text())["weight_map"].values()) - {p.name for p in weights}
        except (ValueError, KeyError) as e:
            return f"{index.name} does not parse ({e})"
        if missing:
            return f"weight shard {sorted(missing)[0]} is missing"
    for name in ("optimizer.pt", "scheduler.pt"):  # the Trainer would silently start both afresh without them
        if not (ckpt / name).exists():
            return f"{name} is missing"
    for p in weights:
        if problem := safetensors_problem(p):
            return problem
    for p in sorted([*ckpt.glob("*.pt"), *ckpt.glob("*.pth"), *ckpt.glob("*.bin")]):
        if problem := torch_save_problem(p):
            return problem
    return None


FSDP_FOLDERS = ("pytorch_model_fsdp_0", "optimizer_0")  # the Trainer's (accelerate's) names for sharded state


def dcp_problem(folder: Path) -> str | None:
    """Why a torch.distributed.checkpoint folder is not whole, or None: its .metadata reads, and every file it
    names is there and reaches the end of the last entry the metadata places in it."""
    if not (folder / ".metadata").exists():
        return f"{folder.name}/.metadata is missing (the sharded save was cut short)"
    from torch.distributed.checkpoint import FileSystemReader  # ~1.5 s to import: only when resuming

    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception as e:  # a truncated pickle: EOFError, UnpicklingError, ...
        return f"{folder.name}/.metadata does not read ({e.__class__.__name__})"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.exists():
            return f"{folder.name}/{name} is missing"
        if path.stat().st_size < end:
            return f"{folder.name}/{name} is {path.stat().st_size} bytes, its metadata says at least {end}"
    return None


class StopCallback(TrainerCallback):
    """SIGTERM/SIGINT (recipe.runs.STOP): save a checkpoint at the end of the current step and stop training.

    On several ranks the signal reaches each rank at a moment of its own (torchrun passes it on rank by rank, or
    one rank alone is signalled): at each step's end the ranks agree (one all-reduce of a flag, world.any), so
    that all of them save the same step and stop after it. One process: the flag as it is."""

    def __init__(self, world: World | None = None):
        self.world = world or World()

    def on_step_end(self, args, state, control, **kwargs):
        if self.world.any(STOP.requested):
            control.should_save = True
            control.should_training_stop = True


def last_complete_checkpoint(ckpt_dir: Path) -> str | None:
    """Newest intact checkpoint-N (see checkpoint_problem). A newer one that is not intact (cut short by a kill,
    truncated) is removed, with one line saying why, so that training resumes from the one before it and the
    Trainer later writes checkpoint-N afresh instead of into the broken folder."""
    ckpts = sorted((p for p in ckpt_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    for p in ckpts:
        problem = checkpoint_problem(p)
        if problem is None:
            return str(p)
        print(f"skipping {p.name}: {problem}; removed it, resuming from the checkpoint before it")
        shutil.rmtree(p, ignore_errors=True)
    return None


class ResumingSFTTrainer(SFTTrainer):
    """SFTTrainer whose resume restores every weight and the token counter.

    Weights: the Trainer (transformers 5.19) loads a checkpoint's model.safetensors with a non-strict
    load_state_dict. save_pretrained writes MoE experts in the hub layout, one key per expert
    (`mlp.experts.0.gate_proj.weight`, ...), while Glm4MoeForCausalLM holds them fused (`mlp.experts.gate_up_proj`,
    `mlp.experts.down_proj`): those keys match nothing, and the routed experts silently kept their start-of-run
    values, with only a warning (transformers issue 48805, fix proposed in PR 48822). Here the checkpoint is read by
    from_pretrained, which converts the per-expert keys to the fused ones, and copied into the model with a strict
    load: a key that still does not match is an error. Peak memory is that of the Trainer's own load (one full
    state dict on the CPU).

    Batches: group_by_length, rows of about one length in a batch (_get_train_sampler).

    Padding: the share of padding tokens in the batches since the last log, as `padding` in metrics.jsonl. With
    rows_per_sequence > 1 the batches come from PackedBatchCollator, and the token counter counts their rows; with
    shared_prefixes from SharedPrefixCollator, the counter counting each row whole and `prefix_spared` the share
    of the rows' tokens that their shared prefixes spared the step.

    Token counter: TRL keeps the `num_tokens` it logs in the trainer (`_total_train_tokens`), which starts at 0 in
    every process, so after a resume the metric restarted from 0. Each checkpoint records it in the TrainerState's
    `num_input_tokens_seen` (the same count: input tokens, padding excluded; the Trainer itself leaves it alone as
    include_num_input_tokens_seen is off), and a resume starts the counter from there.
    """

    def __init__(self, *args, group_by_length: bool = False, fused_lm_head: bool = True, **kwargs):
        self.group_by_length = group_by_length
        self.fused_lm_head = fused_lm_head
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """fused_lm_head=False: the same loss (the summed log-probability of the label tokens over their count) and
        metrics as TRL's, from the model's plain logits. TRL's fused head exists not to hold the (tokens, vocab)
        logits of a large vocabulary; without its Triton kernel (the CPU) it scores every position in vocabulary
        tiles and projects them again in backward, which for the tiny model's 512 tokens cost 12% of a step's
        forward and backward (docs/performance.md). Any other loss TRL offers goes to TRL."""
        if (self.fused_lm_head or return_outputs or self.aux_loss_enabled or self.compute_loss_func is not None
                or self.label_smoother is not None or self.args.loss_type != "nll"):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"][:, 1:]
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits[:, :-1]
        mask = labels != -100
        scored = logits[mask].float()
        log_probs = torch.log_softmax(scored, dim=-1)
        target = labels[mask]
        count = mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.gather(-1, target[:, None]).sum() / torch.as_tensor(count).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # DDP averages the gradients of the ranks (as TRL)
        with torch.no_grad():
            gather = self.accelerator.gather_for_metrics
            valid = gather(mask.sum()).sum()
            entropy = gather(-(log_probs.exp() * log_probs).sum()).sum()
            correct = gather((scored.argmax(-1) == target).sum()).sum()
            metrics = self._metrics["train" if model.training else "eval"]
            metrics["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
            metrics["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)
            if model.training:  # as TRL (PackedBatchCollator's batches are counted again by training_step)
                seen = inputs["attention_mask"].sum() if "attention_mask" in inputs else \
                    torch.tensor(inputs["position_ids"].size(1), device=labels.device)
                self._total_train_tokens += gather(seen).sum().item() // self._tp_size
            metrics["num_tokens"] = [self._total_train_tokens]
        return loss

    def _get_train_sampler(self, train_dataset=None):
        """group_by_length: the whole run's row order (length_grouped_order) as one epoch of max_steps global
        batches, from the lengths of the rows as TRL tokenized and cut them. The ranks take consecutive slices of
        each global batch (accelerate's batch sampler shards), and a resume skips the batches already trained."""
        if not self.group_by_length:
            return super()._get_train_sampler(train_dataset)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        args = self.args
        batch = args.per_device_train_batch_size * args.world_size
        return length_grouped_order([len(ids) for ids in dataset["input_ids"]], batch,
                                    args.max_steps * args.gradient_accumulation_steps, args.seed)

    def training_step(self, model, inputs, *args, **kwargs):
        # the share of padding in this rank's batch, logged (averaged) with TRL's own metrics
        real = inputs.pop("real_tokens", None)  # PackedBatchCollator's and SharedPrefixCollator's count
        rows = inputs.pop("row_tokens", real)  # the rows' own tokens (a shared prefix counts for each of its rows)
        mask = inputs.get("attention_mask")
        if real is not None:
            self._metrics["train"]["padding"].append(1.0 - real / inputs["input_ids"].numel())
            if "tree_rows" in inputs:  # the share of the rows' tokens their shared prefixes spared the step
                self._metrics["train"]["prefix_spared"].append(1.0 - real / rows)
        elif mask is not None:  # TRL's padding-free packing has none
            self._metrics["train"]["padding"].append(1.0 - mask.sum().item() / mask.numel())
        counted = self._total_train_tokens
        loss = super().training_step(model, inputs, *args, **kwargs)
        if real is not None:
            # TRL counts a batch without attention mask as one flat sequence (position_ids.size(1)): count its rows
            tokens = self.accelerator.gather_for_metrics(torch.tensor([rows], device=loss.device)).sum().item()
            self._total_train_tokens = counted + tokens
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return loss

    def _save_checkpoint(self, model, trial):
        self.state.num_input_tokens_seen = self._total_train_tokens
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        state = json.loads((Path(resume_from_checkpoint) / "trainer_state.json").read_text())
        self._total_train_tokens = state.get("num_input_tokens_seen", 0)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or not isinstance(self.model, PreTrainedModel):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # sharded or adapter checkpoints
        try:
            loaded, info = type(self.model).from_pretrained(resume_from_checkpoint, dtype=self.model.dtype,
                                                            output_loading_info=True)
            # from_pretrained fills a weight the checkpoint lacks with a fresh init and only warns: refuse that too
            bad = {k: info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
            if bad:
                raise RuntimeError(bad)
            self.model.load_state_dict(loaded.state_dict(), strict=True)
        except RuntimeError as e:  # also what from_pretrained raises when the experts cannot be fused
            raise StageError(f"checkpoint {resume_from_checkpoint} does not match the model: {e}") from None


def per_device_batch(train_cfg, key: str, ranks: int) -> int:
    """Each rank's share of the global batch `{key}.batch_size`: the same examples make a step at any number of
    ranks (the Trainer's sampler hands rank r the r-th slice of each global batch)."""
    if train_cfg.batch_size % ranks:
        raise ConfigError(f"config error: {key}.batch_size={train_cfg.batch_size} is the global batch and is split "
                          f"evenly over launcher.num_processes={ranks} ranks: make it a multiple of {ranks}")
    share = train_cfg.batch_size // ranks
    if share % train_cfg.rows_per_sequence and not train_cfg.shared_prefixes:  # (a shared-prefix batch is one row)
        raise ConfigError(f"config error: {key}.rows_per_sequence={train_cfg.rows_per_sequence} must divide each "
                          f"rank's {share} rows ({key}.batch_size={train_cfg.batch_size} over {ranks} ranks)")
    return share


class PackedBatchCollator:
    """A batch of tokenized rows as batch/rows_per_sequence sequences, each holding several rows end to end with
    positions restarting at every row, and no attention mask: the rows are read from the position ids (sdpa: the
    model trains with recipe.model.attention's sdpa_rows, a call per 8 rows of about one length; eager: a
    block-diagonal mask; flash-attention: varlen boundaries), so a row attends to itself only and its loss is what
    it is in a padded batch. The step trains the same rows on the same label tokens as a
    padded batch; only the padding goes (the longest-first fill below leaves about 2% at 4 rows a sequence on the
    tiny chat rows, against a third padded).

    Why not TRL's packing: its padding-free collator lays the whole batch into one sequence, and without
    flash-attention's varlen kernel (CPU, sdpa) attention is then quadratic in the whole batch's tokens (measured:
    slower than padding). Here a sequence is only rows_per_sequence rows long.

    `real_tokens` (a plain int, not a model input) carries the count of non-padding tokens to the trainer's
    metrics without reading a device tensor back."""

    def __init__(self, pad_token_id: int, rows_per_sequence: int):
        self.pad_token_id = pad_token_id
        self.rows_per_sequence = rows_per_sequence

    def __call__(self, examples: list[dict]) -> dict:
        count = max(1, len(examples) // self.rows_per_sequence)
        sequences: list[list[dict]] = [[] for _ in range(count)]
        filled = [0] * count
        # longest first, each row into the emptiest sequence: the sequences come out about equally long
        for ex in sorted(examples, key=lambda ex: -len(ex["input_ids"])):
            s = filled.index(min(filled))
            sequences[s].append(ex)
            filled[s] += len(ex["input_ids"])
        width = max(filled)
        input_ids = torch.full((count, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((count, width), -100, dtype=torch.long)
        positions = torch.zeros((count, width), dtype=torch.long)
        for s, rows in enumerate(sequences):
            at = 0
            for ex in rows:
                n = len(ex["input_ids"])
                input_ids[s, at:at + n] = torch.tensor(ex["input_ids"])
                labels[s, at:at + n] = torch.tensor(ex.get("labels", ex["input_ids"]))
                positions[s, at:at + n] = torch.arange(n)
                at += n
            positions[s, at:] = torch.arange(width - at)  # the padding is a row of its own, out of the loss
        labels[positions == 0] = -100  # a row's first token is not predicted from the row before it
        return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "real_tokens": sum(filled)}


def _first_label(labels: list[int]) -> int:
    return next((t for t, label in enumerate(labels) if label != -100), len(labels))


def shared_prefix_plan(rows: list[list[int]], shareable: list[int]) -> list[tuple[int, list[int]]]:
    """The rows (token ids) in groups that share a prefix: [(prefix length, the group's rows)], every row in one
    group, a row alone in its group with prefix 0. A row shares at most its first shareable[i] tokens. In sorted
    order the rows with a common start lie together; the groups are the runs of that order that leave the fewest
    tokens to compute: a run of r rows with a common prefix of p tokens computes it once instead of r times
    (sum of (r - 1) * p over the runs, the most of it, by dynamic programming over where runs end)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    common = []  # the prefix each sorted row shares with the next
    for a, b in zip(order, order[1:]):
        limit = min(len(rows[a]), len(rows[b]), shareable[a], shareable[b])
        p = 0
        while p < limit and rows[a][p] == rows[b][p]:
            p += 1
        common.append(p)
    saved = [0] * (len(order) + 1)  # saved[e]: the most tokens saved by runs over the first e sorted rows
    start_of = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        saved[end], start_of[end], prefix = saved[end - 1], end - 1, None
        for start in range(end - 2, -1, -1):  # the run order[start:end]: its prefix is the least common one in it
            prefix = common[start] if prefix is None else min(prefix, common[start])
            if prefix == 0:
                break
            if saved[start] + (end - start - 1) * prefix > saved[end]:
                saved[end], start_of[end] = saved[start] + (end - start - 1) * prefix, start
    groups, end = [], len(order)
    while end:
        start = start_of[end]
        groups.append((min(common[start:end - 1], default=0), [order[i] for i in range(start, end)]))
        end = start
    return groups[::-1]


class SharedPrefixCollator:
    """A batch of tokenized chat rows as one flat sequence in which each prompt prefix that several rows share is
    computed once (sft.shared_prefixes): the prefix's tokens, then each of those rows without them, every row's
    positions those of its own sequence; a row that shares nothing is laid whole. recipe.model.attention's
    sdpa_tree (TreeRows, `tree_rows` in the batch) lets a row's tokens attend to its prefix and then causally to
    themselves, so every row's logits, loss and gradient are those of the row alone (float rounding). Only prompt
    tokens before the row's first label are shared: a prefix's predictions are in no loss, and a row's first own
    token, whose prediction comes from the prefix's last position in the row's own sequence, is never a label.

    On the tiny chat rows (a task's instructions, the chat template's opening) a random batch of 32 computes about
    a third fewer tokens than packed batches, and its forward and backward took 10 to 30% less time, the less at
    two threads (docs/performance.md, "SFT: a step"). `real_tokens`: the tokens computed (there is no padding);
    `row_tokens`: the rows' own, which the token counter counts, as for the other batches."""

    def __call__(self, examples: list[dict]) -> dict:
        ids = [list(ex["input_ids"]) for ex in examples]
        labels = [list(ex.get("labels", ex["input_ids"])) for ex in examples]
        # a row keeps at least the token before its first label: its first own token is predicted in the row
        shareable = [_first_label(lab) - 1 for lab in labels]
        segments, parents, flat_ids, flat_labels, positions = [], [], [], [], []

        def lay(tokens, targets, first_position, parent):
            segments.append(len(tokens))
            parents.append(parent)
            flat_ids.extend(tokens)
            flat_labels.extend([-100] + targets[1:])  # the first token is predicted from another segment's last
            positions.extend(range(first_position, first_position + len(tokens)))

        for prefix, group in shared_prefix_plan(ids, shareable):
            if len(group) == 1 or prefix == 0:
                for i in group:
                    lay(ids[i], labels[i], 0, -1)
                continue
            parent = len(segments)
            lay(ids[group[0]][:prefix], [-100] * prefix, 0, -1)
            for i in group:
                lay(ids[i][prefix:], labels[i][prefix:], prefix, parent)
        return {"input_ids": torch.tensor([flat_ids]), "labels": torch.tensor([flat_labels]),
                "position_ids": torch.tensor([positions]), "tree_rows": TreeRows(segments, parents),
                "real_tokens": len(flat_ids), "row_tokens": sum(map(len, ids))}


def sharding(model, train_cfg, world: World, use_cpu: bool) -> dict:
    """SFTConfig's FSDP arguments: FSDP2 over the ranks when they train on GPUs, each decoder layer a unit of its
    own (configs/accelerate/fsdp2.yaml's settings), checkpoints as sharded torch.distributed.checkpoint folders
    (each rank writes its shards). Nothing on CPU or in one process: the Trainer then wraps the model in DDP
    (accelerate applies its FSDP plugin to GPU ranks only; on CPU ranks it would silently train DDP anyway).
    With FSDP the activation checkpointing is FSDP's (the Trainer refuses both kinds at once)."""
    if use_cpu or not world.distributed:
        return {}
    return {"fsdp": True,
            "fsdp_config": {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "transformer_layer_cls_to_wrap": [type(model.model.layers[0]).__name__],
                            "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
                            "activation_checkpointing": train_cfg.gradient_checkpointing}}


def train_supervised(model, tokenizer, dataset, train_cfg, stage_dir: Path, use_cpu: bool,
                     world: World | None = None, key: str = "sft", tracking: TrainerTracking | None = None,
                     callbacks: list | None = None) -> Path:
    """Train to train_cfg.max_steps, resuming from the newest checkpoint; returns the final model folder.

    world: this rank (recipe.rl.dist.init_world) when torchrun started several; every rank calls this with the
    same arguments. key: the config section train_cfg is (`sft`, `base`), for the batch check's message.
    tracking: logging.report_to through the Trainer's own integration (recipe.tracking); None: none.
    callbacks: more TrainerCallbacks (make bench-sft's timers)."""
    world = world or World()
    tracking = tracking or TrainerTracking()
    per_device = per_device_batch(train_cfg, key, world.size)
    torch.set_num_threads(train_cfg.threads)
    ckpt_dir = stage_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # rank 0 alone looks and removes a damaged checkpoint; the others wait for its answer
    last = world.broadcast(last_complete_checkpoint(ckpt_dir) if world.main else None)
    resume_step = json.loads((Path(last) / "trainer_state.json").read_text())["global_step"] if last else None
    callbacks = [StopCallback(world), *(callbacks or [])]
    if train_cfg.adapt_threads and use_cpu and not world.distributed:  # ranks share out the cores by design
        callbacks.append(ThreadsCallback(ThreadGovernor(train_cfg.threads), key))
    if world.main:
        callbacks.append(MetricsCallback(MetricsLog(stage_dir / "metrics.jsonl", resume_step=resume_step)))
        if last:
            print(f"resuming from {last} (step {resume_step})")
    fsdp = sharding(model, train_cfg, world, use_cpu)
    args = SFTConfig(
        output_dir=str(ckpt_dir),
        max_steps=train_cfg.max_steps,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=train_cfg.grad_accum,
        learning_rate=train_cfg.lr,
        weight_decay=train_cfg.weight_decay,
        warmup_steps=int(train_cfg.warmup_ratio * train_cfg.max_steps),
        lr_scheduler_type=train_cfg.scheduler,
        max_length=train_cfg.max_length,
        packing=train_cfg.packing,
        save_steps=train_cfg.save_steps,
        save_total_limit=train_cfg.save_total_limit,
        logging_steps=train_cfg.logging_steps,
        bf16=train_cfg.bf16,
        gradient_checkpointing=train_cfg.gradient_checkpointing and not fsdp,  # under FSDP2: FSDP's own
        seed=train_cfg.seed,
        use_cpu=use_cpu,
        **tracking.args,
        dataloader_num_workers=0,
        disable_tqdm=False,
        **fsdp,
    )
    with tracking.environment():
        collator = None
        if train_cfg.shared_prefixes:
            if model.config._attn_implementation != SDPA_GQA or train_cfg.fused_lm_head:
                raise ConfigError(f"config error: {key}.shared_prefixes needs the model's attention to be sdpa "
                                  f"(model.attn_implementation; it is {model.config._attn_implementation}) and "
                                  f"{key}.fused_lm_head=false")
            collator = SharedPrefixCollator()
            model.set_attn_implementation(SDPA_TREE)  # a row attends to its prefix, then to itself
        elif train_cfg.rows_per_sequence > 1:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            collator = PackedBatchCollator(pad, train_cfg.rows_per_sequence)
            if model.config._attn_implementation == SDPA_GQA:  # each row attends within itself, unmasked
                model.set_attn_implementation(SDPA_ROWS)
        trainer = ResumingSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                     data_collator=collator, callbacks=callbacks + tracking.callbacks,
                                     group_by_length=train_cfg.group_by_length,
                                     fused_lm_head=train_cfg.fused_lm_head)
        try:
            with STOP.cooperative():
                trainer.train(resume_from_checkpoint=last)
        finally:  # the model leaves as it came (sdpa_rows and sdpa_tree are for training batches only)
            if model.config._attn_implementation in (SDPA_ROWS, SDPA_TREE):
                model.set_attn_implementation(SDPA_GQA)
    # a collective: every rank has finished its part of the last save before rank 0 looks at the checkpoints
    stop = world.any(STOP.requested)
    # Then a barrier, so that no rank leaves right after that all-reduce. gloo's worker thread releases a finished
    # all-reduce's tensors (which takes the GIL) just after the call returns; a rank leaving at once could free
    # the process group first (the DDP model's last reference, GIL held, joining that thread): a deadlock at
    # exit, ended by torchrun's SIGKILL 30 s later (seen in 2 of 5 SIGTERM stops on 2 CPU ranks). The barrier
    # waits with the GIL released, while the thread lets go of the all-reduce.
    world.barrier()
    if stop:
        if not world.main:
            STOP.stop(f"rank {world.rank} stopped with rank 0 after step {trainer.state.global_step}")
        ckpt = last_complete_checkpoint(ckpt_dir)
        STOP.stop(f"the next run resumes from checkpoint {ckpt}" if ckpt else "the next run starts it over")
    out = stage_dir / "model"
    if trainer.is_fsdp_enabled:  # the final folder holds whole tensors (gathered to rank 0), as transformers loads
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(out))  # a collective under FSDP; rank 0 alone writes (Trainer.args.should_save)
    if world.main:
        tokenizer.save_pretrained(str(out))
    return out


def length_grouped_order(lengths: list[int], batch_size: int, steps: int, seed: int,
                         window: int = 64) -> list[int]:
    """Row indices for `steps` batches of `batch_size`, each batch of rows of about the same length.

    Each pass over the data is a fresh permutation (seeded by seed and the pass) behind the rows the pass before
    left over; it is cut into windows of `window` batches, each window sorted by length and cut into batches,
    and the pass's batches are shuffled, so that a batch's length says nothing about when it is trained. Rows
    short of a whole batch wait for the next pass: every row is trained as often as every other, give or take the
    pass cut short at max_steps. The order for fewer steps is the start of the order for more, and it depends on
    nothing else, so a resumed run and every rank see the same batches, which the Trainer's own length-grouped
    sampler (global RNG, drawn when an epoch starts) does not promise."""
    if len(lengths) < batch_size:
        raise DataError(f"{len(lengths)} rows cannot fill one batch of {batch_size}")
    order: list[int] = []
    left: list[int] = []
    epoch = 0
    while len(order) < steps * batch_size:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        pool = left + torch.randperm(len(lengths), generator=g).tolist()
        whole = len(pool) // batch_size * batch_size
        pool, left = pool[:whole], pool[whole:]
        batches = []
        for start in range(0, whole, window * batch_size):
            chunk = sorted(pool[start:start + window * batch_size], key=lambda i: lengths[i])
            batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
        for b in torch.randperm(len(batches), generator=g).tolist():
            order += batches[b]
        epoch += 1
    return order[:steps * batch_size]


def chat_row_pieces(tokenizer, prompt: list[dict], completion: list[dict],
                    tools: list[dict] | None = None) -> tuple[list[tuple[str, int]], str]:
    """The rendered conversation cut into (text, 1 if the model wrote it) pieces, and the rendered prompt.

    The chat template renders prompt + completion (its <|endoftext|> closes the assistant turn, TRL adds no
    other EOS) and the prompt alone with the generation prompt. Each environment reply in the completion is a
    piece of its own (mask 0), and so is the model turn after it, each to be tokenized on its own as next_reply
    does in RL: the ids are those RL and eval see. tokenize_chat_row says what tools does."""
    kwargs = {"tools": tools} if tools else {}
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kwargs)
    text = tokenizer.apply_chat_template(prompt + completion, tokenize=False, **kwargs)
    # replies are looked for in the completion only: the prompt is the user's text
    completion_start = len(os.path.commonprefix([prompt_text, text]))
    pieces, pos = [], 0
    for m in ENV_REPLY.finditer(text, completion_start):
        pieces += [(text[pos:m.start(1)], 1), (m.group(1), 0)]
        pos = m.end(1)
    pieces.append((text[pos:], 1))
    return pieces, prompt_text


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids without special tokens, as tokenizer.encode gives them one at a time, in one batched call:
    chat_dataset of the tiny preset's 12,000 SFT rows took 5.3 and 5.9 CPU s against 7.8 and 8.5 one text at a time
    (by hand on 2026-12-07; transformers' overhead a call, not the tokenizer's own work)."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_rendered(tokenizer, rendered: list[tuple[list[tuple[str, int]], str]]) -> list[dict[str, list[int]]]:
    """input_ids and assistant_masks of each (pieces, prompt text) of chat_row_pieces, all texts in one call."""
    ids = iter(encode_texts(tokenizer, [t for pieces, prompt_text in rendered
                                        for t in [*(p for p, _ in pieces), prompt_text]]))
    return [ids_and_mask(pieces, [next(ids) for _ in pieces], next(ids)) for pieces, _ in rendered]


def ids_and_mask(pieces: list[tuple[str, int]], piece_ids: list[list[int]],
                 prompt_ids: list[int]) -> dict[str, list[int]]:
    input_ids, mask = [], []
    for (_, trained), ids in zip(pieces, piece_ids, strict=True):
        input_ids += ids
        mask += [trained] * len(ids)
    # the prompt is the leading tokens the conversation shares with the prompt rendered alone (TRL's own rule)
    prompt_len = common_prefix_length(prompt_ids, input_ids)
    mask[:prompt_len] = [0] * prompt_len
    return {"input_ids": input_ids, "assistant_masks": mask}


def tokenize_chat_row(tokenizer, prompt: list[dict], completion: list[dict],
                      tools: list[dict] | None = None) -> dict[str, list[int]]:
    """input_ids and assistant_masks (1 = trained) of one prompt/completion conversation.

    Without a tool reply this is TRL's own processing of a conversational prompt/completion row: one
    tokenization of the rendered text, and the prompt is the leading tokens it shares with the prompt rendered
    alone with the generation prompt (trl.data_utils.common_prefix_length). With tool replies, each reply and
    the model turn after it are tokenized on their own (chat_row_pieces), and the reply's tokens get mask 0.

    tools: JSON schemas the template renders before the messages (a hub model's template in its own system
    block, the tiny template as recipe.chat describes); part of the prompt, so out of the loss. Messages carry
    their tool calls as `tool_calls` (recipe.chat.messages) and tool results as `tool` messages: the template
    renders the calls in the assistant's turn (trained) and the results as environment replies (masked).
    Without tools the template is called exactly as before, so such a row's ids do not change.
    """
    return encode_rendered(tokenizer, [chat_row_pieces(tokenizer, prompt, completion, tools)])[0]


def chat_dataset(rows: list[dict], tokenizer, chunk_rows: int = 1024):
    """Schema rows -> a tokenized dataset (input_ids, assistant_masks) for SFTTrainer: tokenize_chat_row of
    every row, the texts of `chunk_rows` rows encoded in one call.

    TRL builds the labels of a tokenized dataset from an `assistant_masks` column whatever SFTConfig says
    (SFTTrainer._prepare_dataset), then truncates and packs as for its own tokenization. A prompt/completion
    row could only mask the prompt, not the tool reply in the middle of the completion. A row's tool calls and,
    for a demonstration row, its tools list go through the chat template (recipe.chat.messages, template_tools)."""
    out = []
    for first in range(0, len(rows), chunk_rows):
        rendered = []
        for r in rows[first:first + chunk_rows]:
            try:
                prompt, completion, tools = messages(r["prompt"]), messages(r["completion"]), template_tools(r)
            except ValueError as e:  # json.JSONDecodeError included
                raise DataError(f"SFT row {r.get('id')!r}: its tool calls or tools do not parse: {e}") from None
            rendered.append(chat_row_pieces(tokenizer, prompt, completion, tools))
        out += encode_rendered(tokenizer, rendered)
    return Dataset.from_list(out)
