"""Supervised training on TRL's SFTTrainer, shared by `make base` (plain text) and `make sft` (chat data).

TRL does the work: completion-only loss for prompt/completion rows, packing when asked, checkpoints. This
module adds what the recipe needs around it: resume from the last checkpoint, metrics.jsonl, a final model
folder in Hugging Face format.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from recipe.runs import MetricsLog


def _metrics_callback(metrics: MetricsLog):
    from transformers import TrainerCallback

    class MetricsCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and state.is_world_process_zero:
                metrics.log({"step": state.global_step, **{k: v for k, v in logs.items()
                                                            if isinstance(v, (int, float))}})

    return MetricsCallback()


def last_complete_checkpoint(ckpt_dir: Path) -> str | None:
    """Newest checkpoint-N with its trainer_state.json (written last); a checkpoint cut short by a kill is
    removed so that training resumes from the one before it."""
    import shutil

    ckpts = sorted((p for p in ckpt_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    for p in ckpts:
        if (p / "trainer_state.json").exists():
            return str(p)
        shutil.rmtree(p, ignore_errors=True)
    return None


def train_supervised(model, tokenizer, dataset, train_cfg, stage_dir: Path, use_cpu: bool) -> Path:
    """Train to train_cfg.max_steps, resuming from the newest checkpoint; returns the final model folder."""
    from trl import SFTConfig, SFTTrainer

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
                         callbacks=[_metrics_callback(metrics)])
    trainer.train(resume_from_checkpoint=last)
    out = stage_dir / "model"
    trainer.save_model(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def chat_dataset(rows: list[dict]):
    """Schema rows -> TRL's conversational prompt/completion format."""
    from datasets import Dataset

    def msgs(ms):
        return [{"role": m["role"], "content": m["content"]} for m in ms]

    return Dataset.from_list([{"prompt": msgs(r["prompt"]), "completion": msgs(r["completion"])} for r in rows])
