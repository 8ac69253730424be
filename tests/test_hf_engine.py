"""The hf engine's own decode loop: the logprobs it reports are the model's, and finished rows leave the batch."""
import pytest
import torch

from recipe.config import TinyArch
from recipe.inference import SamplingParams
from recipe.inference.hf import HFEngine, _top_p
from recipe.chat import stop_token_ids
from recipe.model import build_tiny_model, build_tokenizer


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


def full_forward_logprobs(engine, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def test_sampled_logprobs_match_an_uncached_forward_of_each_sequence(engine):
    ps = prompts(engine) * 3  # different prompt lengths, left padded in one batch
    out = engine.generate(ps, SamplingParams(max_new_tokens=24, temperature=0.7, top_p=1.0, seed=5))
    lengths = {len(c.token_ids) for c in out}
    assert len(lengths) > 1, "rows must finish at different steps for this test to mean anything"
    for p, c in zip(ps, out):
        ref = full_forward_logprobs(engine, p, c.token_ids, 0.7)
        assert torch.allclose(ref, torch.tensor(c.logprobs), atol=1e-4)
        stopped = c.token_ids[-1] in engine.stop_ids
        assert c.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(c.token_ids) == 24
        assert not any(t in engine.stop_ids for t in c.token_ids[:-1])


def test_greedy_equals_transformers_generate(engine):
    for p in prompts(engine):
        out = engine.generate([p], SamplingParams(max_new_tokens=16, temperature=0.0, seed=0))[0]
        ref = engine.model.generate(input_ids=torch.tensor([p]), max_new_tokens=16, do_sample=False,
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


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = _top_p(logp, 0.7).isfinite()[0].tolist()
    assert kept == [True, True, False, False]
    assert _top_p(logp, 0.45).isfinite()[0].tolist() == [True, False, False, False]
    assert _top_p(logp, 1.0).isfinite().all()
