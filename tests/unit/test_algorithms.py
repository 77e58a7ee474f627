"""GRPO algorithms on hand-computed values, micro-batch equivalence, and the reference."""

from __future__ import annotations

import math

import pytest
import torch

from relax_agent.errors import DataError
from relax_agent.train import reference_grpo as ref
from relax_agent.train.algorithms import (
    APPROX_KL,
    CLIP_FRAC,
    MISMATCH_ABS_DIFF_MAX,
    MISMATCH_ABS_DIFF_MEAN,
    MISMATCH_FRAC_GT_LN2,
    MISMATCH_FRAC_GT_LN5,
    MISMATCH_K3_KL,
    RATIO_MEAN,
    group_advantages,
    k3_kl,
    loss_normalizer,
    masked_aggregate,
    mismatch_metrics,
    ppo_clip_loss,
)


def _t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# -- group advantages -------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    # group 7: rewards 1,0,0,1 -> mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350
    #          -> +-0.5 / (0.577350 + 1e-6) = +-0.866024
    # group 3: rewards 2,0,1 -> mean 1, unbiased std sqrt((1 + 1 + 0) / 2) = 1 -> 1/(1+1e-6), ...
    rewards = _t([1.0, 0.0, 2.0, 0.0, 0.0, 1.0, 1.0])
    groups = _t([7, 7, 3, 7, 3, 7, 3], torch.long)
    valid = torch.ones(7, dtype=torch.bool)
    adv = group_advantages(rewards, groups, valid)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    b = 1.0 / (1.0 + 1e-6)
    expected = _t([a, -a, b, -a, -b, a, 0.0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    assert adv.dtype == torch.float32


def test_dr_grpo_skips_std():
    adv = group_advantages(_t([1.0, 0.0, 0.0, 3.0]), _t([0, 0, 1, 1], torch.long), torch.ones(4, dtype=torch.bool),
                           std_normalize=False)
    torch.testing.assert_close(adv, _t([0.5, -0.5, -1.5, 1.5]))


def test_invalid_samples_are_left_out_and_get_zero():
    # valid rewards of group 0: 1, 0, 1 -> mean 2/3, unbiased std sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3)
    # -> (1/3) / 0.577350 = 0.577349, (-2/3) / 0.577350 = -1.154699; the NaN reward is ignored.
    rewards = _t([1.0, 0.0, float("nan"), 1.0, 5.0])
    groups = _t([0, 0, 0, 0, 1], torch.long)
    valid = _t([True, True, False, True, False], torch.bool)
    adv = group_advantages(rewards, groups, valid)
    s = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(adv, _t([(1 / 3) / s, (-2 / 3) / s, 0.0, (1 / 3) / s, 0.0]), rtol=0, atol=1e-6)


def test_uniform_and_singleton_groups_get_exactly_zero():
    rewards = _t([0.1, 0.1, 0.1, 0.7, 0.3, 0.9])
    groups = _t([0, 0, 0, 1, 2, 2], torch.long)
    valid = _t([True, True, True, True, True, False], torch.bool)
    for std_normalize in (True, False):
        adv = group_advantages(rewards, groups, valid, std_normalize=std_normalize)
        assert adv.tolist() == [0.0] * 6


def test_group_advantages_rejects_bad_input():
    ones = torch.ones(3, dtype=torch.bool)
    with pytest.raises(DataError, match="shapes"):
        group_advantages(_t([1.0, 2.0]), _t([0, 0, 0], torch.long), ones)
    with pytest.raises(DataError, match="integer"):
        group_advantages(_t([1.0, 2.0, 3.0]), _t([0.0, 0.0, 1.0]), ones)
    with pytest.raises(DataError, match="sample 1 is inf"):
        group_advantages(_t([1.0, float("inf"), 3.0]), _t([0, 0, 1], torch.long), ones)


def test_group_advantages_match_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 4, (24,), generator=g).float() / 3
    groups = torch.arange(24) // 6
    valid = torch.rand(24, generator=g) > 0.2
    samples = [ref.Sample([0, 1], [0, 1], [0.0, 0.0], float(r), int(gi), bool(v)) for r, gi, v in zip(rewards, groups, valid, strict=True)]
    for std_normalize in (True, False):
        ours = group_advantages(rewards, groups, valid, std_normalize=std_normalize)
        theirs = _t(ref.compute_advantages(samples, std_normalize=std_normalize))
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


# -- PPO-clip loss ----------------------------------------------------------------------------

# Two sequences, three tokens; log-ratios ln 1, ln 1.5, ln 0.5 -> ratio 1, 1.5, 0.5; clip to [0.8, 1.28].
# seq 0, A = +1:  min(r A, clip(r) A) = 1, 1.28, 0.5        -> loss terms -1, -1.28, -0.5 (token 1 clipped)
# seq 1, A = -2:  min(-2, -2), min(-3, -2.56), min(-1, -1.6) -> loss terms  2,  3,   1.6; token 2 masked out
OLD = _t([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]])
NEW = OLD + _t([[0.0, math.log(1.5), math.log(0.5)], [0.0, math.log(1.5), math.log(0.5)]])
ADV = _t([1.0, -2.0])
MASK = _t([[1, 1, 1], [1, 1, 0]], torch.bool)


def test_ppo_clip_loss_token_mean_hand_computed():
    loss, m = ppo_clip_loss(NEW, OLD, ADV, MASK, 0.2, 0.28, "token_mean")
    assert loss.item() == pytest.approx((-1 - 1.28 - 0.5 + 2 + 3) / 5, abs=1e-6)  # 0.444
    assert m[CLIP_FRAC].item() == pytest.approx(1 / 5)
    assert m[RATIO_MEAN].item() == pytest.approx((1 + 1.5 + 0.5 + 1 + 1.5) / 5, abs=1e-6)  # 1.1
    k3 = {1.0: 0.0, 1.5: 0.5 - math.log(1.5), 0.5: -0.5 - math.log(0.5)}  # (r - 1) - ln r
    assert m[APPROX_KL].item() == pytest.approx((2 * k3[1.5] + k3[0.5]) / 5, abs=1e-6)  # 0.0764434


def test_ppo_clip_loss_seq_mean_hand_computed():
    loss, m = ppo_clip_loss(NEW, OLD, ADV, MASK, 0.2, 0.28, "seq_mean")
    assert loss.item() == pytest.approx(((-1 - 1.28 - 0.5) / 3 + (2 + 3) / 2) / 2, abs=1e-6)  # 0.786667
    assert m[CLIP_FRAC].item() == pytest.approx(1 / 5)


def test_ppo_clip_loss_negative_advantage_clips_low():
    # A = -2, ratio 0.5 < 0.8: the clipped branch (-1.6) is the minimum -> counted as clipped, no gradient.
    new = NEW.clone().requires_grad_(True)
    loss, m = ppo_clip_loss(new, OLD, ADV, torch.ones_like(MASK), 0.2, 0.28, "token_mean")
    loss.backward()
    assert m[CLIP_FRAC].item() == pytest.approx(2 / 6)
    assert new.grad[1, 2].item() == 0.0 and new.grad[0, 1].item() == 0.0
    # unclipped tokens: d(-r A)/d logp = -r A / N
    assert new.grad[0, 2].item() == pytest.approx(-0.5 * 1 / 6, abs=1e-6)
    assert new.grad[1, 1].item() == pytest.approx(1.5 * 2 / 6, abs=1e-6)


def test_masked_positions_do_not_matter():
    junk = NEW.clone()
    junk[1, 2] = 50.0  # would overflow exp() if it were not masked
    a, _ = ppo_clip_loss(NEW, OLD, ADV, MASK, 0.2, 0.28)
    b, _ = ppo_clip_loss(junk, OLD, ADV, MASK, 0.2, 0.28)
    assert a.item() == b.item()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_micro_batches_accumulate_to_full_batch_gradient(agg):
    g = torch.Generator().manual_seed(1)
    b, t = 7, 11
    old = -torch.rand(b, t, generator=g) * 3
    base = old + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.4
    mask[3] = False  # a sequence with no policy tokens
    full_lp = base.clone().requires_grad_(True)
    full_loss, _ = ppo_clip_loss(full_lp, old, adv, mask, 0.2, 0.28, agg)
    full_loss.backward()

    micro_lp = base.clone().requires_grad_(True)
    norm = loss_normalizer(mask, agg)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 5), slice(5, 7)):
        loss, _ = ppo_clip_loss(micro_lp[rows], old[rows], adv[rows], mask[rows], 0.2, 0.28, agg, norm)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full_loss.item(), abs=1e-6)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, rtol=0, atol=1e-7)
    assert full_lp.grad.abs().sum() > 0


def test_loss_normalizer_counts():
    mask = _t([[0, 1, 1], [0, 0, 0], [1, 0, 0]], torch.bool)
    assert loss_normalizer(mask, "token_mean") == 3.0
    assert loss_normalizer(mask, "seq_mean") == 2.0
    assert loss_normalizer(torch.zeros(2, 2, dtype=torch.bool), "token_mean") == 1.0
    with pytest.raises(DataError, match="'sum'"):
        loss_normalizer(mask, "sum")


def test_ppo_clip_loss_rejects_bad_shapes():
    with pytest.raises(DataError, match=r"advantages must be \[B\]=2"):
        ppo_clip_loss(NEW, OLD, _t([1.0]), MASK, 0.2, 0.2)
    with pytest.raises(DataError, match="one \\[B, T\\] shape"):
        ppo_clip_loss(NEW, OLD[:, :2], ADV, MASK, 0.2, 0.2)


def test_ppo_clip_loss_matches_reference_formula():
    # the reference computes token by token from a model; here the same formula on plain tensors
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(4, 6, generator=g)
    new = old + torch.randn(4, 6, generator=g) * 0.4
    adv = torch.randn(4, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    for agg in ("token_mean", "seq_mean"):
        per_seq = []
        for i in range(4):
            terms = []
            for t in range(6):
                if mask[i, t]:
                    r = torch.exp(new[i, t] - old[i, t])
                    terms.append(-torch.minimum(r * adv[i], torch.clamp(r, 0.8, 1.28) * adv[i]))
            if terms:
                per_seq.append(terms)
        if agg == "token_mean":
            expected = sum(sum(ts) for ts in per_seq) / sum(len(ts) for ts in per_seq)
        else:
            expected = sum(sum(ts) / len(ts) for ts in per_seq) / len(per_seq)
        loss, _ = ppo_clip_loss(new, old, adv, mask, 0.2, 0.28, agg)
        assert loss.item() == pytest.approx(float(expected), abs=1e-6)


# -- KL and mismatch --------------------------------------------------------------------------


def test_k3_kl_hand_computed():
    # delta = ref - logp = 0.5, -1, 0 -> exp(d) - 1 - d = 0.148721, 0.367879, 0
    logp = _t([[-1.0, -0.5, -2.0]])
    ref_lp = _t([[-0.5, -1.5, -2.0]])
    k = k3_kl(logp, ref_lp, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(k, _t([[math.exp(0.5) - 1.5, math.exp(-1.0), 0.0]]))
    masked = k3_kl(logp, ref_lp, _t([[1, 0, 1]], torch.bool))
    assert masked[0, 1].item() == 0.0
    assert masked_aggregate(k, torch.ones(1, 3), "token_mean").item() == pytest.approx(
        (math.exp(0.5) - 1.5 + math.exp(-1.0)) / 3
    )


def test_k3_kl_stays_finite_for_huge_log_ratios():
    k = k3_kl(_t([[-200.0]]), _t([[0.0]]), torch.ones(1, 1, dtype=torch.bool))
    assert torch.isfinite(k).all() and k.item() == pytest.approx(math.exp(20) - 21)


def test_mismatch_metrics_hand_computed():
    # delta = train - rollout on the 3 masked tokens: 0.1, -0.8, 2.0 (the 4th token is masked)
    rollout = _t([[-1.0, -1.0, -3.0, -1.0]])
    train = _t([[-0.9, -1.8, -1.0, 9.0]])
    mask = _t([[1, 1, 1, 0]], torch.bool)
    m = mismatch_metrics(train, rollout, mask)
    deltas = [0.1, -0.8, 2.0]
    assert m[MISMATCH_ABS_DIFF_MEAN] == pytest.approx((0.1 + 0.8 + 2.0) / 3, abs=1e-6)
    assert m[MISMATCH_ABS_DIFF_MAX] == pytest.approx(2.0, abs=1e-6)
    assert m[MISMATCH_FRAC_GT_LN2] == pytest.approx(2 / 3)  # 0.8 and 2.0 exceed ln 2 = 0.693
    assert m[MISMATCH_FRAC_GT_LN5] == pytest.approx(1 / 3)  # only 2.0 exceeds ln 5 = 1.609
    expected_k3 = sum(math.exp(d) - 1 - d for d in deltas) / 3  # KL(rollout || train), sampled from rollout
    assert m[MISMATCH_K3_KL] == pytest.approx(expected_k3, abs=1e-6)


def test_mismatch_metrics_empty_mask_is_zero():
    m = mismatch_metrics(torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool))
    assert set(m.values()) == {0.0}
