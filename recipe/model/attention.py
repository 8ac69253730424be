"""sdpa attention with grouped key/value heads passed as they are (enable_gqa), on the CPU too.

transformers' sdpa copies every key/value head num_key_value_groups times before the call whenever there is a
mask and the device is not one it trusts with masked GQA (CPU included). A decode step then re-copies the whole KV
cache, which costs about ten times the attention itself on the tiny model (128 rows, 4 query heads on 2 key/value
heads); padded and packed training batches pay it too. torch's CPU sdpa takes the grouped heads with a mask:
the forward is the same to the last bit, gradients agree to float rounding (tests/test_hf_engine.py,
tests/test_trainer.py). Other devices go to transformers' own sdpa unchanged.

Models load with it wherever the config says sdpa (recipe.model.load_pretrained, build_tiny_model); the name is not
saved with the model, so a saved folder loads anywhere with the stock sdpa.
"""
from __future__ import annotations

import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_GQA = "sdpa_gqa"


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    if query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True,
                                         is_causal=query.shape[2] > 1 and attention_mask is None and causal)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)


def implementation(name: str) -> str:
    """The attention a model is loaded with for the config's `name`: sdpa_gqa for sdpa, others as they are."""
    return SDPA_GQA if name == "sdpa" else name
