"""Off-policy correction: truncated importance sampling (TIS) math and its trainer hook."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from relax_agent.errors import DataError
from relax_agent.train.algorithms import (
    IW_CLIPPED_FRAC,
    IW_MAX,
    IW_MEAN,
    importance_weight_metrics,
    ppo_clip_loss,
    tis_weights,
)
from relax_agent.train.backends.torch_backend import TorchTrainer
from tests.unit.test_torch_trainer import base_model, cfg, grads, make_batch, rollout_batch  # noqa: F401


def test_tis_weights_are_the_ratio_truncated_at_the_cap():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.5, -1.0, -3.0]])
    w = tis_weights(old, rollout, cap=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 2.0]])
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def test_tis_weights_refuse_bad_input():
    with pytest.raises(DataError, match="cap must be >= 1"):
        tis_weights(torch.zeros(1, 2), torch.zeros(1, 2), cap=0.5)
    with pytest.raises(DataError, match="share one shape"):
        tis_weights(torch.zeros(1, 2), torch.zeros(1, 3), cap=2.0)


def test_tis_loss_gradient_is_weight_times_advantage_per_token():
    """With the ratio against the detached pre-update log-probs, d loss / d logp = -w * A / N."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    rollout = torch.tensor([[-1.2, -1.0, -3.0], [-0.3, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.5, -0.5])
    w = tis_weights(logp.detach(), rollout, cap=2.0)
    loss, metrics = ppo_clip_loss(logp, logp.detach(), adv, mask, 0.2, 0.28, "token_mean", token_weights=w)
    loss.backward()
    expected = -(w * adv[:, None]) * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected)
    assert float(metrics["train/ratio_mean"]) == pytest.approx(1.0)
    assert float(metrics["train/clip_frac"]) == 0.0


def test_token_weights_must_match_the_logprobs_shape():
    logp = torch.zeros(2, 3)
    with pytest.raises(DataError, match="token_weights"):
        ppo_clip_loss(logp, logp, torch.zeros(2), torch.ones(2, 3), 0.2, 0.2, token_weights=torch.ones(2, 2))


def test_importance_weight_metrics():
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    rollout = torch.tensor([0.0, -math.log(4.0), math.log(2.0), -math.log(1.5)])
    m = importance_weight_metrics(old, rollout, cap=2.0)
    assert m[IW_MEAN] == pytest.approx((1 + 4 + 0.5 + 1.5) / 4)
    assert m[IW_MAX] == pytest.approx(4.0)
    assert m[IW_CLIPPED_FRAC] == pytest.approx(0.25)
    assert importance_weight_metrics(torch.zeros(0), torch.zeros(0), 2.0)[IW_MEAN] == 0.0


def test_trainer_tis_on_policy_equals_plain_ppo(base_model):  # noqa: F811
    """On-policy (rollout log-probs = the trainer's), TIS weights are 1 and the gradient is unchanged."""
    batch = make_batch(rollout_batch(base_model, n=8, noise=0.0))
    plain = TorchTrainer(copy.deepcopy(base_model), cfg(off_policy="none"))
    tis = TorchTrainer(copy.deepcopy(base_model), cfg(off_policy="tis", tis_cap=2.0))
    plain.compute_gradients(batch)
    m = tis.compute_gradients(batch)
    g_plain, g_tis = grads(plain.model), grads(tis.model)
    for name in g_plain:
        torch.testing.assert_close(g_tis[name], g_plain[name], rtol=1e-4, atol=1e-6, msg=name)
    assert m[IW_MEAN] == pytest.approx(1.0, abs=1e-4) and m[IW_CLIPPED_FRAC] == 0.0


def test_trainer_tis_truncates_stale_tokens(base_model):  # noqa: F811
    """Rollout log-probs far below the trainer's (a stale policy) give weights capped at tis_cap."""
    trajs = rollout_batch(base_model, n=8, noise=0.0)
    stale = [t.__class__(**{**t.__dict__, "rollout_logprobs": tuple(
        lp - 3.0 if m else 0.0 for lp, m in zip(t.rollout_logprobs, t.loss_mask, strict=True))}) for t in trajs]
    tis = TorchTrainer(copy.deepcopy(base_model), cfg(off_policy="tis", tis_cap=2.0))
    m = tis.train_step(make_batch(stale))
    assert m[IW_CLIPPED_FRAC] == pytest.approx(1.0)
    assert m[IW_MAX] == pytest.approx(math.exp(3.0), rel=1e-3)
    assert math.isfinite(m["train/loss"])
