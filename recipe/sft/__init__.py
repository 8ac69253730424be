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
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.data_utils import common_prefix_length

from recipe.chat import ENV_REPLY, messages
from recipe.runs import STOP, MetricsLog


class MetricsCallback(TrainerCallback):
    """Trainer logs -> metrics.jsonl (one process writes it)."""

    def __init__(self, metrics: MetricsLog):
        self.metrics = metrics

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            self.metrics.log({"step": state.global_step, **{k: v for k, v in logs.items()
                                                             if isinstance(v, (int, float))}})


class StopCallback(TrainerCallback):
    """SIGTERM/SIGINT (recipe.runs.STOP): save a checkpoint at the end of the current step and stop training."""

    def on_step_end(self, args, state, control, **kwargs):
        if STOP.requested:
            control.should_save = True
            control.should_training_stop = True


def last_complete_checkpoint(ckpt_dir: Path) -> str | None:
    """Newest checkpoint-N with its trainer_state.json (written last); a checkpoint cut short by a kill is
    removed so that training resumes from the one before it."""
    ckpts = sorted((p for p in ckpt_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    for p in ckpts:
        if (p / "trainer_state.json").exists():
            return str(p)
        shutil.rmtree(p, ignore_errors=True)
    return None


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
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
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
