"""Model and tokenizer factory.

tiny: a byte-level BPE tokenizer trained here (digits split into single tokens, GLM-4.5's chat tokens) and a
Glm4MoeForCausalLM of about a million parameters. Real presets: the hub model id at a pinned revision.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Glm4MoeConfig, Glm4MoeForCausalLM,
                          PreTrainedTokenizerFast)

from recipe import hub
from recipe.chat import CHAT_TEMPLATE, ENDOFTEXT, SPECIAL_TOKENS, stop_token_ids
from recipe.errors import StageError
from recipe.model.attention import implementation


def build_tokenizer(texts, vocab_size: int):
    tok = Tokenizer(models.BPE())
    # single-digit tokens: arithmetic over multi-digit tokens is much harder for a small model to learn
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return _wrap_tokenizer(tok)


def tokenizer_from_str(text: str):
    """The tokenizer build_tokenizer made, from its backend's JSON (`tokenizer.backend_tokenizer.to_str()`): how
    the ranks of `make base` take rank 0's tokenizer instead of each training one."""
    return _wrap_tokenizer(Tokenizer.from_str(text))


def _wrap_tokenizer(tok: Tokenizer):
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=ENDOFTEXT, pad_token="<|pad|>",
                                   chat_template=CHAT_TEMPLATE, padding_side="left",
                                   model_max_length=100_000)


def glm4moe_config(arch, **extra) -> Glm4MoeConfig:
    """A Glm4MoeConfig from a model.tiny or model.arch block (a dataclass or its config node); `extra` (the
    tokenizer's vocabulary and token ids) wins over the block."""
    fields = OmegaConf.to_container(arch) if isinstance(arch, DictConfig) else dataclasses.asdict(arch)
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta"),
            "partial_rotary_factor": fields.pop("partial_rotary_factor")}
    # the config records the MTP layers; transformers builds none (and this recipe never trains them)
    mtp = fields.pop("num_nextn_predict_layers", 0)
    # the tiny block leaves these out: the GLM-4.5-Air values
    kwargs = {"norm_topk_prob": True, "tie_word_embeddings": False, "use_qk_norm": False, **fields,
              "rope_parameters": rope, "num_mtp_layers": mtp, **extra}
    return Glm4MoeConfig(**kwargs)


def build_tiny_model(arch, tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    config = glm4moe_config(arch, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=stop_token_ids(tokenizer))
    model = Glm4MoeForCausalLM(config)
    model.set_attn_implementation(implementation("sdpa"))
    model.generation_config.eos_token_id = stop_token_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def meta_model(model_cfg):
    """The trainer's model on the meta device (shapes, no memory), or None where the config states no
    architecture: the tiny model from model.tiny (its vocabulary is model.tiny.vocab_size, the size the
    tokenizer of `make base` is trained to), a hub model from model.arch."""
    arch = model_cfg.tiny if model_cfg.hub_id is None else model_cfg.arch
    if arch is None:
        return None
    with torch.device("meta"):
        return Glm4MoeForCausalLM(glm4moe_config(arch))


def count_params(model) -> tuple[int, int]:
    """(total, active a token). Active: every weight a token's forward pass multiplies by, so neither the input
    embedding (a row lookup) nor the routed experts the router does not pick (top-k of n)."""
    cfg = model.config
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".mlp.experts." in name:  # stacked routed experts [n_routed_experts, ...]
            active += p.numel() * cfg.num_experts_per_tok // cfg.n_routed_experts
        elif "embed_tokens" not in name:
            active += p.numel()
    return total, active


HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # owner/name (or name): anything else is a local path
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def check_model_folder(folder: Path) -> None:
    """A local model folder has its config, tokenizer and weights (what save_pretrained writes)."""
    if not folder.is_dir():
        raise StageError(f"model folder {folder} is not a folder")
    missing = [n for n in ("config.json", "tokenizer.json", "tokenizer_config.json") if not (folder / n).exists()]
    if not any((folder / n).exists() for n in WEIGHTS):
        missing.append(" or ".join(WEIGHTS))
    if missing:
        raise StageError(f"model folder {folder} lacks {', '.join(missing)}: redo the stage that wrote it "
                         f"(force=true)")


def load_pretrained(path_or_id: str, revision: str | None = None, dtype: str = "float32",
                    attn_implementation: str = "sdpa", weights: bool = True):
    """Load model and tokenizer from a local folder, or from the hub at a pinned revision (clear error offline).
    weights=False: the model is built from its config on the meta device (no memory, no weights read), for a
    trainer rank that receives its shards from rank 0 (recipe.rl.dist.load_sharded)."""
    local = Path(path_or_id).exists()
    attn_implementation = implementation(attn_implementation)
    kwargs = {}
    if local:
        check_model_folder(Path(path_or_id))
    elif not revision and not HUB_ID.match(str(path_or_id)):
        raise StageError(f"model folder {path_or_id} does not exist: redo the stage that wrote it (force=true)")
    else:
        if not revision:
            raise StageError(f"model {path_or_id}: no revision given; every hub reference must be pinned")
        hub.ensure_reachable([hub.Ref("models", path_or_id, revision)], timeout=10.0)
        kwargs = {"revision": revision, "local_files_only": hub.offline()}
    what = "tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path_or_id, **kwargs)
        what = "model"
        if weights:
            model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=getattr(torch, dtype),
                                                         attn_implementation=attn_implementation, **kwargs)
        else:
            config = AutoConfig.from_pretrained(path_or_id, **kwargs)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                         attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:  # a damaged or foreign file
        where = "the local folder" if local else (f"the local HF cache at revision {revision} (offline mode is on; "
                                                  f"{hub.HOWTO})" if hub.offline() else f"the hub at revision {revision}")
        detail = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, SafetensorError):
            detail = f"a weights file is truncated or corrupt ({detail})"
        raise StageError(f"cannot load the {what} of {path_or_id} from {where}: {detail}") from None
    return model, tokenizer
