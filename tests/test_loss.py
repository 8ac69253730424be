"""The RL loss of docs/recipe.md, checked against values computed by hand."""
import math

import torch

from recipe.rl.loss import completion_logprobs, masked_is_loss


def _lp(values):
    return torch.tensor([values], dtype=torch.float64)


def test_ratio_inside_band_gives_ratio_times_advantage_over_step_tokens():
    logp_infer = _lp([math.log(0.5), math.log(0.5)])
    logp_train = _lp([math.log(0.6), math.log(0.4)])  # ratios 1.2 and 0.8: both kept
    loss, stats = masked_is_loss(logp_train, logp_infer, torch.tensor([2.0]), torch.ones(1, 2), total_loss_tokens=4)
    assert math.isclose(loss.item(), -(1.2 * 2 + 0.8 * 2) / 4, rel_tol=1e-9)
    assert stats["kept_tokens"] == 2 and stats["masked_low"] == 0 and stats["masked_high"] == 0


def test_double_sided_token_mask():
    logp_infer = _lp([0.0, 0.0, 0.0, 0.0])
    ratios = [0.4, 0.6, 4.0, 6.0]  # below 0.5 and above 5 are dropped
    logp_train = _lp([math.log(r) for r in ratios])
    loss, stats = masked_is_loss(logp_train, logp_infer, torch.tensor([1.0]), torch.ones(1, 4), total_loss_tokens=4)
    assert math.isclose(loss.item(), -(0.6 + 4.0) / 4, rel_tol=1e-9)
    assert stats["masked_low"] == 1 and stats["masked_high"] == 1 and stats["kept_tokens"] == 2


def test_sequence_mask_drops_whole_sequence_when_any_ratio_is_tiny():
    logp_infer = _lp([0.0, 0.0]).repeat(2, 1)
    logp_train = torch.tensor([[0.0, math.log(1e-6)], [0.0, 0.0]], dtype=torch.float64)
    loss, stats = masked_is_loss(logp_train, logp_infer, torch.tensor([1.0, 3.0]), torch.ones(2, 2),
                                 total_loss_tokens=4)
    # only the second sequence counts: 2 tokens of ratio 1 times advantage 3, over all 4 tokens of the step
    assert math.isclose(loss.item(), -(3.0 + 3.0) / 4, rel_tol=1e-9)
    assert stats["masked_sequences"] == 1 and stats["masked_sequence_tokens"] == 2


def test_environment_and_padding_tokens_are_not_in_the_loss():
    logp = _lp([0.0, 0.0, 0.0])
    mask = torch.tensor([[1, 0, 1]])  # the middle token was written by the environment
    loss, stats = masked_is_loss(logp, logp, torch.tensor([1.0]), mask, total_loss_tokens=2)
    assert math.isclose(loss.item(), -1.0, rel_tol=1e-9)
    assert stats["loss_tokens"] == 2


def test_gradient_flows_through_the_ratio_unclipped():
    logp_train = torch.tensor([[math.log(2.0)]], dtype=torch.float64, requires_grad=True)
    loss, _ = masked_is_loss(logp_train, _lp([0.0]), torch.tensor([1.0]), torch.ones(1, 1), total_loss_tokens=1)
    loss.backward()
    # d(-r*A)/d logp = -r*A = -2
    assert math.isclose(logp_train.grad.item(), -2.0, rel_tol=1e-9)


def test_trainer_logits_are_divided_by_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = completion_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert math.isclose(lp.item(), math.log(math.e / (math.e + 1)), rel_tol=1e-6)
