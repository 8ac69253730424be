"""recipe.rl.muon and the trainer's optimizer split: what INTELLECT-3's production run (prime-rl at PR 1272, dion's
Muon at 3c4bce5) put under Muon on GLM-4.5-Air, the update a step makes, and its settings. (2 ranks against 1
process: tests/test_distributed.py.)"""
import math

import pytest
import torch

from recipe.config import OptimizerKind, RLConfig, load_config
from recipe.model import meta_model
from recipe.rl.muon import Muon, orthogonalise
from recipe.rl.trainer import build_optimizer, optimizer_split


pytestmark = pytest.mark.usefixtures("one_thread")


def test_glm45_air_has_every_weight_with_two_dims_or_more_under_muon_but_embeddings_and_head():
    cfg = load_config(["preset=intellect3"])
    model = meta_model(cfg.model)
    muon, adamw = optimizer_split(model.named_parameters(), cfg.rl.optimizer)
    assert {n for n, p in adamw if p.ndim >= 2} == {"model.embed_tokens.weight", "lm_head.weight"}
    names = {n for n, _ in muon}
    for layer in (0, 1, 45):
        assert f"model.layers.{layer}.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names  # the dense layer
    assert {f"model.layers.1.mlp.{k}" for k in ("gate.weight", "shared_experts.up_proj.weight",
                                                "experts.gate_up_proj", "experts.down_proj")} <= names
    total = sum(p.numel() for _, p in model.named_parameters())
    in_muon = sum(p.numel() for _, p in muon)
    # 98.84%: the embeddings and the head (2 x 151552 x 4096 = 1.24B) are 1.16% of 106.85B; norms and biases 1.0M
    assert in_muon == 105_609_691_136 and total == 106_852_245_504
    assert 0.988 < in_muon / total < 0.989
    assert sum(p.numel() for _, p in muon if p.ndim == 3) / total > 0.93  # the routed experts
    # build_optimizer on the meta model: the fused expert gate_up_proj is split into gate and up
    opt = build_optimizer(model, cfg.rl)
    muon_opt, adamw_opt = opt.optimizers
    by_id = {id(p): n for n, p in model.named_parameters()}
    fused = [g for g in muon_opt.param_groups if g["row_blocks"] == 2]
    assert len(fused) == 1 and {by_id[id(p)].rsplit(".", 1)[1] for p in fused[0]["params"]} == {"gate_up_proj"}
    assert len(fused[0]["params"]) == 45  # the 45 MoE layers


def test_muon_settings_are_the_production_run_s_and_adamw_the_tiny_preset_s():
    rl = load_config(["preset=intellect3"]).rl
    assert rl.optimizer == OptimizerKind.muon and rl.lr == 1e-6 and rl.weight_decay == 0.01
    assert rl.muon_momentum == 0.95 and rl.muon_nesterov is False
    assert (rl.adam_beta1, rl.adam_beta2, rl.adam_eps) == (0.9, 0.95, 1e-8)
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(8, 4), "proj": torch.nn.Linear(4, 6)})
    muon, adamw = build_optimizer(model, rl).optimizers
    assert all(g["momentum"] == 0.95 and g["nesterov"] is False and g["weight_decay"] == 0.01 and g["lr"] == 1e-6
               and g["eps"] == 1e-8 for g in muon.param_groups)
    assert [p for g in muon.param_groups for p in g["params"]] == [model["proj"].weight]
    (g,) = adamw.param_groups
    assert g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 and g["weight_decay"] == 0.01 and g["lr"] == 1e-6
    assert len(g["params"]) == 2  # the embedding and the bias
    tiny = load_config(["preset=tiny", "run_root=unused"]).rl
    (only,) = build_optimizer(model, tiny).optimizers  # AdamW on everything, torch's betas
    assert isinstance(only, torch.optim.AdamW) and only.param_groups[0]["betas"] == (0.9, 0.999)


def reference_steps(w0, grads, lr, mu, wd, nesterov=False):
    """dion's Muon written out by hand (dion/muon.py:536-602, 620-647) for one 2-D matrix, step after step."""
    coefficients = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                    (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
    w, m = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        m = mu * m + g
        x = (mu * m + g if nesterov else m).bfloat16()
        tall = x.shape[0] > x.shape[1]
        if tall:
            x = x.T
        x = x / (x.norm() + 1e-8)
        for a, b, c in coefficients:
            s = x @ x.T
            x = a * x + (b * s + c * (s @ s)) @ x
        if tall:
            x = x.T
        w = w * (1 - lr * wd)
        w = w - x * (lr * 0.2 * math.sqrt(max(w0.shape)))
    return w


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_a_step_is_momentum_newton_schulz_rms_scale_and_decoupled_weight_decay(shape):
    torch.manual_seed(0)
    w0 = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.02, weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = reference_steps(w0, grads, lr=0.02, mu=0.95, wd=0.1)
    assert (p.detach() - expected).abs().max() < 1e-6
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    assert torch.allclose(opt.state[p]["momentum_buffer"], 0.95 ** 2 * grads[0] + 0.95 * grads[1] + grads[2])
    # nesterov off is what the step did: nesterov on is another update
    q = torch.nn.Parameter(w0.clone())
    opt_n = Muon([q], lr=0.02, weight_decay=0.1, nesterov=True)
    for g in grads:
        q.grad = g.clone()
        opt_n.step()
    assert (q.detach() - reference_steps(w0, grads, 0.02, 0.95, 0.1, nesterov=True)).abs().max() < 1e-6
    assert (q.detach() - p.detach()).abs().max() > 1e-3
    # the update's RMS is about 0.2 lr (Newton-Schulz leaves singular values in about 0.7-1.2)
    r = torch.nn.Parameter(torch.zeros(64, 256))
    r.grad = torch.randn(64, 256)
    Muon([r], lr=1.0, weight_decay=0.0).step()
    assert 0.15 < r.detach().pow(2).mean().sqrt() < 0.25


def test_a_3d_step_is_each_expert_s_own_2d_step_and_fused_gate_up_is_two_matrices():
    """A [experts, rows, cols] tensor is a batch of matrices, each updated as a 2-D parameter of its own (lr scaled
    by its own dims); with row_blocks=2 (transformers' fused gate_up_proj) each expert's gate and up halves are."""
    torch.manual_seed(0)
    experts, rows, cols = 3, 8, 5
    for blocks in (1, 2):
        w0 = torch.randn(experts, rows, cols)
        grads = [torch.randn(experts, rows, cols) for _ in range(2)]
        stacked = torch.nn.Parameter(w0.clone())
        h = rows // blocks
        own = [torch.nn.Parameter(w0[e, k * h:(k + 1) * h].clone()) for e in range(experts) for k in range(blocks)]
        opt3 = Muon([stacked], lr=0.05, weight_decay=0.1, row_blocks=blocks)
        opt2 = Muon(own, lr=0.05, weight_decay=0.1)
        for g in grads:
            stacked.grad = g.clone()
            for i, p in enumerate(own):
                e, k = divmod(i, blocks)
                p.grad = g[e, k * h:(k + 1) * h].clone()
            opt3.step()
            opt2.step()
        for i, p in enumerate(own):
            e, k = divmod(i, blocks)
            assert torch.equal(stacked.detach()[e, k * h:(k + 1) * h], p.detach()), (blocks, i)
    # fused and split are not the same update: orthogonalising [gate; up] together mixes the two
    fused, split = orthogonalise(grads[0][0]), orthogonalise(grads[0][0].unflatten(0, (2, h))).flatten(0, 1)
    assert (fused.float() - split.float()).abs().max() > 0.05


def test_orthogonalise_gives_singular_values_near_one_and_torch_muon_takes_no_3d_weight():
    torch.manual_seed(0)
    for shape in [(32, 96), (96, 32), (4, 16, 48)]:
        s = torch.linalg.svdvals(orthogonalise(torch.randn(shape)).float())
        assert s.min() > 0.6 and s.max() < 1.3, (shape, s.min(), s.max())
    with pytest.raises(ValueError):
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 3, 4))])


def test_muon_refuses_vectors_and_rows_that_do_not_split():
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.zeros(2, 5, 4))], lr=0.1, row_blocks=2)
    assert RLConfig().muon_momentum == 0.95 and RLConfig().muon_nesterov is False
