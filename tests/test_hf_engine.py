"""The hf engine's own decode loop: the logprobs it reports are the model's, and finished rows leave the batch.

The engine runs its own attention (grouped key/value heads without copies) and KV cache (written in place): the
references below are the same model with transformers' stock sdpa and its dynamic cache."""
import copy

import pytest
import torch

from recipe.config import TinyArch
from recipe.inference import SamplingParams
from recipe.inference.hf import HFEngine, _inverse_cdf, _top_p
from recipe.chat import stop_token_ids
from recipe.model import build_tiny_model, build_tokenizer
from recipe.model.attention import SDPA_GQA


@pytest.fixture(scope="module")
def engine():
    texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    tok = build_tokenizer(texts, vocab_size=128)
    arch = TinyArch(hidden_size=64, intermediate_size=128, num_hidden_layers=2, moe_intermediate_size=32,
                    n_routed_experts=4, max_position_embeddings=256)
    model = build_tiny_model(arch, tok, seed=0)
    # a random model rarely stops: make one stop token likely so rows end at different steps
    with torch.no_grad():
        model.lm_head.weight[stop_token_ids(tok)[0]] *= 0.0
        model.lm_head.weight[stop_token_ids(tok)[0]] += 0.02
    return HFEngine(model, tok, stop_token_ids(tok), batch_size=16)


def prompts(engine):
    return [engine.tokenizer(f"{a}+{b}=")["input_ids"] for a, b in [(1, 2), (12, 34), (7, 29), (3, 3), (25, 1)]]


def stock(engine):
    """The engine's model with transformers' own sdpa attention."""
    model = copy.deepcopy(engine.model)
    model.set_attn_implementation("sdpa")
    return model


def full_forward_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def test_sampled_logprobs_match_an_uncached_forward_of_each_sequence(engine):
    ps = prompts(engine) * 3  # different prompt lengths, left padded in one batch
    out = engine.generate(ps, SamplingParams(max_new_tokens=24, temperature=0.7, top_p=1.0, seed=5))
    lengths = {len(c.token_ids) for c in out}
    assert len(lengths) > 1, "rows must finish at different steps for this test to mean anything"
    assert engine.model.config._attn_implementation == SDPA_GQA
    reference = stock(engine)
    for p, c in zip(ps, out):
        ref = full_forward_logprobs(reference, p, c.token_ids, 0.7)
        assert torch.allclose(ref, torch.tensor(c.logprobs), atol=1e-4)
        stopped = c.token_ids[-1] in engine.stop_ids
        assert c.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(c.token_ids) == 24
        assert not any(t in engine.stop_ids for t in c.token_ids[:-1])


def test_a_decode_steps_attention_is_sdpas_for_each_mask_and_a_row_with_nothing_to_attend_stays_finite():
    """sdpa_gqa takes one query a row (a decode step) as two matrix products; the keys are a strided view, as the
    engine's buffers give them."""
    import torch.nn.functional as F

    from recipe.model.attention import sdpa_gqa_attention

    torch.manual_seed(0)
    rows, heads, kv_heads, dim, length = 6, 4, 2, 8, 11
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    query = torch.randn(rows, 1, heads, dim).transpose(1, 2)  # as the model hands it: a transposed view
    keys = torch.randn(rows, kv_heads, length + 5, dim)[:, :, 2:2 + length]
    values = torch.randn(rows, kv_heads, length + 5, dim)[:, :, 2:2 + length]
    allowed = torch.rand(rows, 1, 1, length) > 0.4
    allowed[:, ..., -1] = True
    additive = torch.zeros(rows, 1, 1, length).masked_fill(~allowed, float("-inf"))
    for mask in (allowed, additive, None):
        ours, _ = sdpa_gqa_attention(module, query, keys, values, mask, scaling=0.3)
        ref = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.3, enable_gqa=True)
        assert ours.shape == (rows, 1, heads, dim)
        torch.testing.assert_close(ours, ref.transpose(1, 2), atol=1e-6, rtol=0)
    allowed[0] = False  # a row with nothing to attend (a slot no row uses)
    assert torch.isfinite(sdpa_gqa_attention(module, query, keys, values, allowed)[0]).all()


def test_greedy_equals_transformers_generate(engine):
    reference = stock(engine)
    for p in prompts(engine):
        out = engine.generate([p], SamplingParams(max_new_tokens=16, temperature=0.0, seed=0))[0]
        ref = reference.generate(input_ids=torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                    eos_token_id=engine.stop_ids, pad_token_id=engine.pad_id)[0, len(p):].tolist()
        n = next((j + 1 for j, t in enumerate(ref) if t in engine.stop_ids), len(ref))
        assert out.token_ids == ref[:n]


def test_same_seed_same_samples_different_seed_different_samples(engine):
    ps = prompts(engine)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11)
    a = engine.generate(ps, params)
    b = engine.generate(ps, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    c = engine.generate(ps, SamplingParams(max_new_tokens=12, temperature=1.0, seed=12))
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_a_request_samples_the_same_tokens_alone_in_a_batch_of_five_or_at_another_position(engine):
    """Each row samples from its own generator seeded with its own request's seed: its tokens do not depend on
    its batch's other rows, its position in the batch or the batch's size (nor the padding width)."""
    ps = prompts(engine)
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=100 + i) for i in range(5)]
    alone = engine.generate_each([ps[1]], [params[1]])[0]
    in_five = engine.generate_each(ps, params)[1]
    moved = engine.generate_each([ps[3], ps[0], ps[4], ps[2], ps[1]], [params[j] for j in (3, 0, 4, 2, 1)])[4]
    wide = engine.generate_each([ps[1], ps[1] + ps[2] + ps[3]], [params[1], params[2]])[0]  # padded wider
    for other in (in_five, moved, wide):
        assert other.token_ids == alone.token_ids
        assert other.logprobs == pytest.approx(alone.logprobs, abs=1e-5)  # batched numerics: ~1e-7 on CPU
    assert len({tuple(c.token_ids) for c in engine.generate_each([ps[1]] * 5, params)}) > 1  # seeds do matter


def test_generate_seeds_prompt_i_with_seed_plus_i_as_the_vllm_client(engine):
    ps = prompts(engine)
    out = engine.generate(ps, SamplingParams(max_new_tokens=12, temperature=1.0, seed=40))
    each = engine.generate_each(ps, [SamplingParams(max_new_tokens=12, temperature=1.0, seed=40 + i) for i in range(5)])
    assert [c.token_ids for c in out] == [c.token_ids for c in each]


def test_rows_with_different_sampling_settings_are_generated_each_with_their_own(engine):
    ps = prompts(engine)[:2]
    greedy, hot = SamplingParams(max_new_tokens=4, temperature=0.0), SamplingParams(max_new_tokens=9, seed=1)
    a, b = engine.generate_each(ps, [greedy, hot])
    assert a.token_ids == engine.generate_each([ps[0]], [greedy])[0].token_ids and len(a.token_ids) <= 4
    assert b.token_ids == engine.generate_each([ps[1]], [hot])[0].token_ids and len(b.token_ids) <= 9


def test_inverse_cdf_draws_from_each_rows_distribution_and_never_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.8, 0.0]])
    assert _inverse_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 0]
    assert _inverse_cdf(probs, torch.tensor([0.49, 0.25])).tolist() == [1, 2]
    assert _inverse_cdf(probs, torch.tensor([0.5, 0.9999999])).tolist() == [3, 2]
    assert _inverse_cdf(probs, torch.tensor([1.0, 1.0])).tolist() == [3, 2]  # u * total rounded up to the total
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    drawn = _inverse_cdf(torch.tensor([[0.1, 0.6, 0.3]]).expand(20000, 3), u)
    assert torch.bincount(drawn, minlength=3).div(20000).sub(torch.tensor([0.1, 0.6, 0.3])).abs().max() < 0.02


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = _top_p(logp, 0.7).isfinite()[0].tolist()
    assert kept == [True, True, False, False]
    assert _top_p(logp, 0.45).isfinite()[0].tolist() == [True, False, False, False]
    assert _top_p(logp, 1.0).isfinite().all()


def test_reloading_weights_every_step_keeps_no_objects_behind(engine, tmp_path):
    """A long RL run reloads the weights once a step: nothing may pile up per reload (safetensors' safe_open
    kept about two objects per tensor each time, which `make soak` saw as a creeping engine RSS)."""
    import gc
    import tracemalloc

    from safetensors.torch import save_file

    path = tmp_path / "policy.safetensors"
    save_file({k: v.contiguous() for k, v in engine.model.state_dict().items()}, path)
    engine.update_weights(path, 1)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for v in range(30):
            engine.update_weights(path, v)
        gc.collect()
        grown = sum(d.count_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    tensors = len(engine.model.state_dict())
    assert grown < tensors, f"{grown} objects left by 30 reloads of {tensors} tensors"


def test_top_k_keeps_the_k_likeliest_tokens_and_top_p_applies_to_what_is_left(engine):
    from recipe.inference.hf import _top_k

    logp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]), -1)
    kept = _top_k(logp, 2)
    assert torch.isinf(kept[0, 2:]).all() and torch.allclose(kept[0, :2].exp().sum(), torch.tensor(1.0))
    assert torch.equal(_top_k(logp, -1), logp) and torch.equal(_top_k(logp, 0), logp)
    # top-p over the renormalised top-2: token 0 alone holds 0.73 of that mass
    assert torch.isinf(_top_p(_top_k(logp, 2), 0.7)[0, 1:]).all()
    # top_k 1 samples the argmax: the greedy tokens, and the reported logprobs stay the full distribution's
    for p in prompts(engine)[:2]:
        greedy = engine.generate([p], SamplingParams(max_new_tokens=8, temperature=0.0, seed=0))[0]
        one = engine.generate([p], SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, seed=3))[0]
        assert one.token_ids == greedy.token_ids
        ref = full_forward_logprobs(engine.model, p, one.token_ids, 1.0)
        assert torch.allclose(ref, torch.tensor(one.logprobs), atol=1e-4)


def test_prompts_join_as_rows_finish_and_each_gets_what_it_gets_alone(engine):
    """Continuous batching: three times batch_size prompts of different lengths and max_new_tokens; rows join the
    running batch as others finish. Each completion is the one its prompt gets alone, and its logprobs are the
    stock model's."""
    base = prompts(engine)
    ps = [base[i % 5] + base[(i * 3) % 5][: i % 4] for i in range(3 * engine.batch_size)]
    params = [SamplingParams(max_new_tokens=4 + i % 9, temperature=1.0, seed=500 + i) for i in range(len(ps))]
    together = engine.generate_each(ps, params)
    reference = stock(engine)
    lengths = set()
    for p, q, c in zip(ps, params, together):
        alone = engine.generate_each([p], [q])[0]
        assert c.token_ids == alone.token_ids
        assert len(c.token_ids) <= q.max_new_tokens
        assert c.finish_reason == ("stop" if c.token_ids[-1] in engine.stop_ids else "length")
        ref = full_forward_logprobs(reference, p, c.token_ids, 1.0)
        assert torch.allclose(ref, torch.tensor(c.logprobs), atol=1e-4)
        lengths.add(len(c.token_ids))
    assert len(lengths) > 3  # rows finished at many different steps


@pytest.mark.parametrize("written_out", [True, False])
def test_a_groups_samples_share_one_prefill_of_their_prompt_and_each_gets_what_it_gets_alone(engine, monkeypatch,
                                                                                              written_out):
    """A group's samples (one prompt, different seeds) join together: the prompt is prefilled once, each row copies
    its cache, and every sample is the one its prompt and seed get alone; through the written-out prefill and
    through transformers' forward."""
    from recipe.inference import glm4moe_step

    base = prompts(engine)
    ps = [base[0]] * 6 + [base[1]] * 5 + [base[2]]
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=900 + i) for i in range(len(ps))]
    monkeypatch.setattr(engine, "written_out_decode", written_out)
    prefill_rows = []
    prefill = glm4moe_step.prefill_logits
    monkeypatch.setattr(glm4moe_step, "prefill_logits",
                        lambda model, ids, *a: prefill_rows.append(ids.shape) or prefill(model, ids, *a))
    hook = engine.model.register_forward_pre_hook(
        lambda m, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape) if kwargs["input_ids"].shape[1] > 1
        else None, with_kwargs=True)
    try:
        together = engine.generate_each(ps, params)
    finally:
        hook.remove()
    assert [shape[0] for shape in prefill_rows] == [3]  # three distinct prompts, one prefill
    alone = [engine.generate_each([p], [q])[0] for p, q in zip(ps, params)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for c, a in zip(together, alone):
        assert c.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert len({tuple(c.token_ids) for c in together[:6]}) > 1  # the shared prompt's rows sample apart


def test_rows_that_join_a_running_batch_take_free_slots_in_place_and_each_gets_what_it_gets_alone(engine):
    """A row that joins goes into a spare row of the buffers without moving the others (one layout of the cache
    for the whole run here); a row that finishes leaves the buffers in its step, the last running rows moving into
    its slot, so that a decode step runs the running rows only; every completion is the one its prompt gets alone,
    and the stock model's logprobs."""
    from recipe.inference.hf import DecodeBatch
    base = prompts(engine)
    ps = [base[i % 5] + base[(i * 3) % 5][: i % 3] for i in range(40)]
    params = [SamplingParams(max_new_tokens=3 + i % 11, temperature=1.0, seed=700 + i) for i in range(len(ps))]
    batch = DecodeBatch(engine, params[0])
    first = 6
    batch.admit(list(range(first)), ps[:first], params[:first])
    waiting = list(range(first, len(ps)))
    out, joined_in_place, steps, moved = {}, 0, 0, 0
    while waiting or len(batch):
        if waiting and steps % 2 and batch.width >= max(len(ps[i]) for i in waiting[:3]):
            take, waiting = waiting[:3], waiting[3:]
            before = (batch.relayouts, [r for r, k in enumerate(batch.keys) if k is not None])
            batch.admit(take, [ps[i] for i in take], [params[i] for i in take])
            if batch.relayouts == before[0]:
                joined_in_place += 1
                assert [r for r, k in enumerate(batch.keys) if k is not None and k not in take] == before[1]
        rows_before = list(batch.keys)
        done = batch.step()
        out.update(done)
        steps += 1
        if batch.keys:  # the running rows, and only they, in the buffers' first rows
            assert None not in batch.keys and len(batch.keys) == len(batch) == batch.cache.layers[0].keys.shape[0]
        finished = {key for key, _ in done}
        last = [k for k in rows_before if k not in finished][-1:] if batch.keys else []
        # the last running row sat past the rows still running: it moved up, into a finished row's slot
        if last and rows_before.index(last[0]) >= len(batch.keys):
            moved += 1
            assert batch.keys.index(last[0]) < rows_before.index(last[0])
    assert joined_in_place >= 5 and joined_in_place > batch.relayouts and moved >= 5
    reference = stock(engine)
    for i, (p, q) in enumerate(zip(ps, params)):
        alone = engine.generate_each([p], [q])[0]
        assert out[i].token_ids == alone.token_ids
        ref = full_forward_logprobs(reference, p, out[i].token_ids, 1.0)
        assert torch.allclose(ref, torch.tensor(out[i].logprobs), atol=1e-4)


def _glm_variant(tok, dtype=torch.float32, **arch):
    """A small Glm4MoeForCausalLM with every bias and the router's correction bias random (built ones are zero)."""
    from transformers import Glm4MoeForCausalLM

    from recipe.model import glm4moe_config
    from recipe.model.attention import implementation

    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=3, first_k_dense_replace=1, partial_rotary_factor=0.5, rope_theta=10000.0,
                  attention_bias=True, max_position_embeddings=256, vocab_size=len(tok))
    fields.update(arch)
    torch.manual_seed(3)
    model = Glm4MoeForCausalLM(glm4moe_config(TinyArch(**{k: v for k, v in fields.items() if hasattr(TinyArch, k)}),
                                              **{k: v for k, v in fields.items() if not hasattr(TinyArch, k)},
                                              pad_token_id=tok.pad_token_id, eos_token_id=stop_token_ids(tok)))
    model.set_attn_implementation(implementation("sdpa"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(std=0.3)
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.1)
    return model.to(dtype)


@pytest.mark.parametrize("variant", [
    {},  # the recipe's layout: one expert group, normalised weights
    {"n_group": 2, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 2.5, "use_qk_norm": True},
    {"dtype": torch.bfloat16},
])
def test_the_written_out_decode_step_gives_transformers_logits_and_cache(engine, variant):
    """recipe.inference.glm4moe_step against transformers' forward of the same model: the prefill of left-padded
    prompts of different lengths, then decode steps on the engine's buffers: the same logits and the same keys and
    values written, after the prefill and after the steps."""
    from recipe.inference import glm4moe_step
    from recipe.inference.hf import DecodeBatch

    variant = dict(variant)
    dtype = variant.pop("dtype", torch.float32)
    model = _glm_variant(engine.tokenizer, dtype, **variant)
    assert glm4moe_step.supported(model)
    fast = HFEngine(model, engine.tokenizer, engine.stop_ids, batch_size=16)
    assert fast.written_out_decode
    ps = [p + p[: i % 4] for i, p in enumerate(prompts(engine) * 2)]
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=40 + i) for i in range(len(ps))]
    caches = []
    for written in (True, False):
        fast.written_out_decode = written
        batch = DecodeBatch(fast, params[0])
        batch.admit(list(range(len(ps))), ps, params)
        states = [([layer.keys.clone() for layer in batch.cache.layers], batch.logits.clone())]  # the prefill's
        for _ in range(3):
            batch.step()
        caches.append(states + [([layer.keys.clone() for layer in batch.cache.layers], batch.logits.clone())])
    tol = {"atol": 0, "rtol": 0} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # float32: every bit
    for (keys_w, logits_w), (keys_t, logits_t) in zip(*caches):
        torch.testing.assert_close(logits_w, logits_t, **tol)
        for a, b in zip(keys_w, keys_t):
            torch.testing.assert_close(a, b, **tol)
    fast.written_out_decode = True
    out = fast.generate_each(ps, params)
    fast.written_out_decode = False
    ref = fast.generate_each(ps, params)
    if dtype == torch.float32:  # bf16 rounding may flip a sample: the logits' closeness above is its check
        assert [c.token_ids for c in out] == [c.token_ids for c in ref]
        for a, b in zip(out, ref):
            assert a.logprobs == b.logprobs


def test_the_engine_keeps_transformers_decode_for_a_model_the_written_out_step_does_not_cover(engine):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from recipe.inference import glm4moe_step

    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(engine.tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=16, pad_token_id=engine.pad_id))
    other = HFEngine(qwen, engine.tokenizer, engine.stop_ids, batch_size=4)
    assert not other.written_out_decode
    out = other.generate(prompts(engine)[:2], SamplingParams(max_new_tokens=4, temperature=1.0, seed=1))
    assert all(len(c.token_ids) >= 1 for c in out)
    glm = copy.deepcopy(engine.model)
    glm.config.rope_parameters = {**glm.config.rope_parameters, "rope_type": "linear", "factor": 2.0}
    assert not glm4moe_step.supported(glm)
    assert glm4moe_step.supported(engine.model) and engine.written_out_decode
