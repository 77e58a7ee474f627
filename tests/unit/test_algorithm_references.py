"""Every objective, advantage estimator, mismatch correction and overlong shaping of
``relax_agent.train.algorithms`` against its loop-based twin in ``relax_agent.train.reference_algorithms``
(values and gradients, random inputs and edge cases), plus small cases computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from relax_agent.errors import ConfigError, DataError
from relax_agent.train import algorithms as A
from relax_agent.train import reference_algorithms as ref

LOSSES = ("ppo_clip", "gspo", "cispo")
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
MODES = ("tis", "seq_tis", "icepop", "geo_mask", "seq_reject")


def _final_advantages(estimator, rewards, groups, valid, counts):
    """The vectorised path as the loop runs it: group-level values, then the batch normalisation."""
    adv = A.estimator_advantages(estimator, rewards, groups, valid)
    if estimator in A.BATCH_NORMALIZED:
        adv = A.batch_normalized_advantages(adv, counts, valid)
    return adv


def _random_batch(seed: int, b: int = 7, t: int = 10):
    """[B, T] float64 log-probs etc. with the edge cases: a fully masked row, a one-token row, and a
    row whose ratio is far out of every band (old log-probs 4 nats below)."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logprobs + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    rollout = old + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[:, 0] = False
    mask[0] = False  # no policy token
    mask[1] = False
    mask[1, 5] = True  # one policy token
    old[2] = logprobs[2] - 4.0  # ratio e^4: far out of bounds
    rollout[3] = old[3] + 3.0  # rollout far likelier than the trainer
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    weights = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    return logprobs, old, rollout, mask, adv, weights


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("with_weights", [False, True])
def test_policy_losses_match_the_reference_in_value_and_gradient(name, agg, seed, with_weights):
    logprobs, old, _, mask, adv, weights = _random_batch(seed)
    clip = (0.2, 0.28) if name != "gspo" else (0.05, 0.08)
    ours_lp = logprobs.clone().requires_grad_(True)
    loss, metrics = A.policy_loss(name, ours_lp, old, adv, mask, *clip, agg,
                                  token_weights=weights if with_weights else None)
    loss.backward()
    ref_lp = logprobs.clone().requires_grad_(True)
    expected = ref.policy_loss(name, ref_lp, old.tolist(), adv.tolist(), mask.int().tolist(), *clip, agg,
                               weights.tolist() if with_weights else None)
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-10, abs=1e-12)
    assert torch.allclose(ours_lp.grad, ref_lp.grad, rtol=1e-9, atol=1e-12)
    assert bool((ours_lp.grad[~mask] == 0).all())  # no gradient off the mask
    assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("name", LOSSES)
def test_micro_batches_add_up_to_the_full_batch(name):
    logprobs, old, _, mask, adv, _ = _random_batch(5)
    for agg in ("token_mean", "seq_mean"):
        full, _ = A.policy_loss(name, logprobs, old, adv, mask, 0.2, 0.28, agg)
        norm = A.loss_normalizer(mask, agg)
        parts = [A.policy_loss(name, logprobs[s], old[s], adv[s], mask[s], 0.2, 0.28, agg, norm)[0]
                 for s in (slice(0, 3), slice(3, 7))]
        assert float(sum(parts)) == pytest.approx(float(full), rel=1e-12)


def test_fully_masked_batch_gives_zero_loss_and_no_gradient():
    logprobs = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    for name in LOSSES:
        loss, _ = A.policy_loss(name, logprobs, logprobs.detach() - 1, torch.ones(2, dtype=torch.float64), mask, 0.2, 0.2)
        loss.backward()
        assert float(loss.detach()) == 0.0 and bool((logprobs.grad == 0).all())
        logprobs.grad = None


def test_gspo_by_hand():
    # one sequence, log ratios 0.2 and 0.0: s = exp(0.1); A = 1
    lp = torch.tensor([[0.0, -1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, -1.2, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True]])
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, m = A.gspo_loss(lp, old, adv, mask, 0.2, 0.2, "seq_mean")
    loss.backward()
    s = math.exp(0.1)
    assert float(loss.detach()) == pytest.approx(-s)
    # d(-s)/d lp_t = -s / |y| on each token
    assert lp.grad[0].tolist() == pytest.approx([0.0, -s / 2, -s / 2])
    assert float(m[A.CLIP_FRAC]) == 0.0 and float(m[A.RATIO_MEAN]) == pytest.approx(s)
    lp.grad = None
    loss, m = A.gspo_loss(lp, old, adv, mask, 0.2, 0.05, "seq_mean")  # s > 1.05: clipped
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.05)
    assert lp.grad.abs().max() == 0.0 and float(m[A.CLIP_FRAC]) == 1.0


def test_cispo_by_hand():
    # ratio exp(0.5) = 1.65 clipped to 1.28 (no gradient through it); A = 2; log pi = -1
    lp = torch.tensor([[0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, -1.5]], dtype=torch.float64)
    mask = torch.tensor([[False, True]])
    loss, m = A.cispo_loss(lp, old, torch.tensor([2.0], dtype=torch.float64), mask, 0.2, 0.28)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(2.56)  # -1.28 * 2 * (-1)
    assert lp.grad[0].tolist() == pytest.approx([0.0, -2.56])  # the clipped token keeps its gradient
    assert float(m[A.CLIP_FRAC]) == 1.0


def test_unknown_loss_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.loss='ppo'"):
        A.policy_loss("ppo", torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), 0.2, 0.2)


# -- advantages --------------------------------------------------------------------------------------

def _reward_batch(seed: int):
    """Four groups of 5: random rewards, one group with two failed episodes (invalid, NaN reward), one
    group whose rewards are all equal, one group with a single valid sample."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(20, generator=g, dtype=torch.float64).round(decimals=1)
    groups = torch.arange(20) // 5
    valid = torch.ones(20, dtype=torch.bool)
    valid[5:7] = False
    rewards[5:7] = float("nan")
    rewards[10:15] = 0.5
    valid[16:20] = False
    counts = torch.randint(1, 30, (20,), generator=g).to(torch.float64)
    return rewards, groups, valid, counts


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantage_estimators_match_the_reference(estimator, seed):
    rewards, groups, valid, counts = _reward_batch(seed)
    ours = _final_advantages(estimator, rewards, groups, valid, counts)
    theirs = ref.advantages(estimator, rewards.tolist(), groups.tolist(), valid.tolist(), counts.int().tolist())
    assert ours.tolist() == pytest.approx(theirs, abs=1e-9)
    assert bool((ours[~valid] == 0).all())


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_all_rewards_equal_give_zero_advantages(estimator):
    rewards = torch.full((6,), 0.7, dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    out = _final_advantages(estimator, rewards, groups, torch.ones(6, dtype=torch.bool), torch.full((6,), 3.0))
    assert out.abs().max() < 1e-6


def test_rloo_by_hand():
    adv = A.leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long),
                                     torch.ones(4, dtype=torch.bool))
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # = k/(k-1) times Dr. GRPO's
    dr = A.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long),
                            torch.ones(4, dtype=torch.bool), std_normalize=False)
    assert adv.tolist() == pytest.approx((dr * 4 / 3).tolist())


def test_reinforce_pp_by_hand():
    # two one-token samples, rewards 1 and 0: mean 0.5, unbiased var 0.5 -> +-0.5 / sqrt(0.5)
    out = A.batch_normalized_advantages(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.ones(2, dtype=torch.bool))
    assert out.tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], rel=1e-6)
    # token weighting: the long sample pulls the mean towards its reward
    out = A.batch_normalized_advantages(torch.tensor([1.0, 0.0]), torch.tensor([3.0, 1.0]), torch.ones(2, dtype=torch.bool))
    mean, var = 0.75, (3 * 0.25 ** 2 + 0.75 ** 2) / 3
    assert out.tolist() == pytest.approx([0.25 / math.sqrt(var), -0.75 / math.sqrt(var)], rel=1e-6)
    assert mean == 0.75


def test_estimator_errors():
    with pytest.raises(ConfigError, match="trainer.advantage='ppo'"):
        A.estimator_advantages("ppo", torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))
    with pytest.raises(DataError, match="non-finite"):
        A.batch_normalized_advantages(torch.tensor([math.nan, 1.0]), torch.ones(2), torch.ones(2, dtype=torch.bool))


# -- mismatch corrections ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_mismatch_corrections_match_the_reference(mode, seed):
    _, old, rollout, mask, _, _ = _random_batch(seed)
    low, high = (0.8, 1.25) if mode in ("geo_mask", "seq_reject") else (0.5, 2.0)
    weights, metrics = A.mismatch_correction(old, rollout, mask, mode, low, high)
    w_ref, m_ref = ref.mismatch_weights(old.tolist(), rollout.tolist(), mask.int().tolist(), mode, low, high)
    assert torch.allclose(weights, torch.tensor(w_ref, dtype=weights.dtype), rtol=1e-10, atol=1e-12)
    assert not weights.requires_grad
    for key, value in m_ref.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-12), key


def test_tis_mode_gives_the_old_tis_weights():
    _, old, rollout, mask, _, _ = _random_batch(3)
    weights, _ = A.mismatch_correction(old, rollout, mask, "tis", 0.5, 2.0)
    assert torch.equal(weights[mask], A.tis_weights(old, rollout, 2.0)[mask])


def test_mismatch_by_hand():
    # three policy tokens with ratios 0.4, 1.0, 3.0 in one sequence
    old = torch.log(torch.tensor([[1.0, 0.4, 1.0, 3.0]], dtype=torch.float64))
    rollout = torch.zeros(1, 4, dtype=torch.float64)
    mask = torch.tensor([[False, True, True, True]])
    w, m = A.mismatch_correction(old, rollout, mask, "icepop", 0.5, 2.0)
    assert w[0].tolist() == pytest.approx([0.0, 0.0, 1.0, 0.0])
    assert float(m[A.CORR_MASKED_TOKEN_FRAC]) == pytest.approx(2 / 3) and float(m[A.CORR_MASKED_SEQ_FRAC]) == 0.0
    w, m = A.mismatch_correction(old, rollout, mask, "tis", 0.5, 2.0)
    assert w[0].tolist() == pytest.approx([0.0, 0.4, 1.0, 2.0]) and float(m[A.CORR_CLIPPED_TOKEN_FRAC]) == pytest.approx(1 / 3)
    w, m = A.mismatch_correction(old, rollout, mask, "seq_tis", 0.5, 2.0)  # prod 1.2
    assert w[0].tolist() == pytest.approx([0.0, 1.2, 1.2, 1.2])
    w, _ = A.mismatch_correction(old, rollout, mask, "geo_mask", 0.5, 2.0)  # geo 1.2 ** (1/3) in band
    assert w.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    w, m = A.mismatch_correction(old, rollout, mask, "seq_reject", 0.5, 2.0)  # 0.4 and 3.0 are out
    assert w.tolist() == [[0.0, 0.0, 0.0, 0.0]] and float(m[A.CORR_MASKED_SEQ_FRAC]) == 1.0
    assert A.mismatch_correction(old, rollout, mask, "none") == (None, {})


def test_mismatch_bounds_are_checked():
    with pytest.raises(ConfigError, match="0 < low <= 1 <= high"):
        A.mismatch_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "icepop", 1.5, 2.0)
    with pytest.raises(ConfigError, match="trainer.mismatch.mode='foo'"):
        A.mismatch_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "foo", 0.5, 2.0)


# -- overlong shaping --------------------------------------------------------------------------------

def test_overlong_penalty_matches_the_reference_and_the_hand():
    lengths = torch.arange(0, 21)
    ours = A.overlong_penalty(lengths, 16, 4, 0.5)
    assert ours.tolist() == pytest.approx([ref.overlong_penalty(int(n), 16, 4, 0.5) for n in lengths])
    assert A.overlong_penalty(torch.tensor([12, 14, 16, 17]), 16, 4).tolist() == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ConfigError, match="buffer_tokens=17"):
        A.overlong_penalty(lengths, 16, 17)
