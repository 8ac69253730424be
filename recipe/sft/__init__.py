"""Supervised training on TRL's SFTTrainer, shared by `make base` (plain text) and `make sft` (chat data).

TRL does the work: loss masking, packing when asked, checkpoints. This module adds what the recipe needs
around it: resume from the last checkpoint, metrics.jsonl, a final model folder in Hugging Face format, and
chat rows tokenized here (`chat_dataset`) so that a tool-use demonstration leaves the environment's reply out
of the loss, as RL does.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PreTrainedModel, TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.data_utils import common_prefix_length

from recipe.chat import ENV_REPLY, messages
from recipe.errors import StageError
from recipe.runs import STOP, MetricsLog, safetensors_problem, torch_save_problem


class MetricsCallback(TrainerCallback):
    """Trainer logs -> metrics.jsonl (one process writes it)."""

    def __init__(self, metrics: MetricsLog):
        self.metrics = metrics

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            self.metrics.log({"step": state.global_step, **{k: v for k, v in logs.items()
                                                             if isinstance(v, (int, float))}})


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None when it is intact.

    Checked from sizes and headers, not by loading: a safetensors file must be exactly as long as its header says
    (8-byte length, JSON header, then the data its offsets end at), a torch.save file (optimizer.pt, scheduler.pt,
    rng_state.pth, training_args.bin) must open as a zip, whose central directory sits at the very end of the file,
    and trainer_state.json must parse. That catches every truncated or missing file, which is what a kill, a full
    disk or a lost page cache leaves, and costs a few reads however large the model; loading the optimizer state
    here would read it twice (the Trainer loads it again). A file torn in the middle with its length intact is not
    caught."""
    try:
        json.loads((ckpt / "trainer_state.json").read_text())["global_step"]
    except FileNotFoundError:
        return "trainer_state.json is missing (the save was cut short)"
    except (ValueError, KeyError) as e:
        return f"trainer_state.json does not parse ({e})"
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


class StopCallback(TrainerCallback):
    """SIGTERM/SIGINT (recipe.runs.STOP): save a checkpoint at the end of the current step and stop training."""

    def on_step_end(self, args, state, control, **kwargs):
        if STOP.requested:
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

    Token counter: TRL keeps the `num_tokens` it logs in the trainer (`_total_train_tokens`), which starts at 0 in
    every process, so after a resume the metric restarted from 0. Each checkpoint records it in the TrainerState's
    `num_input_tokens_seen` (the same count: input tokens, padding excluded; the Trainer itself leaves it alone as
    include_num_input_tokens_seen is off), and a resume starts the counter from there.
    """

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


def train_supervised(model, tokenizer, dataset, train_cfg, stage_dir: Path, use_cpu: bool) -> Path:
    """Train to train_cfg.max_steps, resuming from the newest checkpoint; returns the final model folder."""
    torch.set_num_threads(train_cfg.threads)
    ckpt_dir = stage_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    last = last_complete_checkpoint(ckpt_dir)
    resume_step = json.loads((Path(last) / "trainer_state.json").read_text())["global_step"] if last else None
    metrics = MetricsLog(stage_dir / "metrics.jsonl", resume_step=resume_step)
    if last:
        print(f"resuming from {last} (step {resume_step})")
    args = SFTConfig(
        output_dir=str(ckpt_dir),
        max_steps=train_cfg.max_steps,
        per_device_train_batch_size=train_cfg.batch_size,
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
        gradient_checkpointing=train_cfg.gradient_checkpointing,
        seed=train_cfg.seed,
        use_cpu=use_cpu,
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    trainer = ResumingSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[MetricsCallback(metrics), StopCallback()])
    with STOP.cooperative():
        trainer.train(resume_from_checkpoint=last)
    if STOP.requested:
        ckpt = last_complete_checkpoint(ckpt_dir)
        STOP.stop(f"the next run resumes from checkpoint {ckpt}" if ckpt else "the next run starts it over")
    out = stage_dir / "model"
    trainer.save_model(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def tokenize_chat_row(tokenizer, prompt: list[dict], completion: list[dict]) -> dict[str, list[int]]:
    """input_ids and assistant_masks (1 = trained) of one prompt/completion conversation.

    Without a tool reply this is TRL's own processing of a conversational prompt/completion row: the chat
    template renders prompt + completion (its <|endoftext|> closes the assistant turn, TRL adds no other EOS),
    one tokenization of that text, and the prompt is the leading tokens it shares with the prompt rendered alone
    with the generation prompt (trl.data_utils.common_prefix_length). Each environment reply is cut out of the
    text and tokenized on its own, as next_reply does in RL, and so is the model turn after it: the ids are
    those RL and eval see, and the reply's tokens get mask 0.
    """
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    # replies are looked for in the completion only: the prompt is the user's text
    completion_start = len(os.path.commonprefix([prompt_text, text]))
    pieces, pos = [], 0  # (text, 1 if the model wrote it)
    for m in ENV_REPLY.finditer(text, completion_start):
        pieces += [(text[pos:m.start(1)], 1), (m.group(1), 0)]
        pos = m.end(1)
    pieces.append((text[pos:], 1))
    input_ids, mask = [], []
    for piece, trained in pieces:
        ids = tokenizer.encode(piece, add_special_tokens=False)
        input_ids += ids
        mask += [trained] * len(ids)
    prompt_len = common_prefix_length(tokenizer.encode(prompt_text, add_special_tokens=False), input_ids)
    mask[:prompt_len] = [0] * prompt_len
    return {"input_ids": input_ids, "assistant_masks": mask}


def chat_dataset(rows: list[dict], tokenizer):
    """Schema rows -> a tokenized dataset (input_ids, assistant_masks) for SFTTrainer.

    TRL builds the labels of a tokenized dataset from an `assistant_masks` column whatever SFTConfig says
    (SFTTrainer._prepare_dataset), then truncates and packs as for its own tokenization. A prompt/completion
    row could only mask the prompt, not the tool reply in the middle of the completion."""
    return Dataset.from_list([tokenize_chat_row(tokenizer, messages(r["prompt"]), messages(r["completion"]))
                              for r in rows])
