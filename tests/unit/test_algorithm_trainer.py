"""The objectives, estimators, mismatch corrections and overlong shaping as the trainer and the loop
run them: the torch trainer's gradient against the loop-based reference through a real model, the
config keys and their aliases, the advantage consumer's shaping."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from relax_agent.config import OverlongConfig, load_config
from relax_agent.control.advantages import (
    OVERLONG_MASKED,
    OVERLONG_PENALTY_MEAN,
    OVERLONG_TRUNCATED_FRAC,
    overlong_metrics,
    overlong_shaping,
)
from relax_agent.errors import ConfigError
from relax_agent.records import Turn
from relax_agent.train import reference_algorithms as ref
from relax_agent.train import reference_grpo
from relax_agent.train.backends.torch_backend import TorchTrainer
from relax_agent.train.batch import collate, trajectory_advantages
from tests.unit.test_torch_trainer import PAD, base_model, cfg, grads, make_traj, rollout_batch  # noqa: F401


def _reference_gradients(model, trajs, adv, loss, clip, agg, mode="none", low=0.5, high=2.0):
    """The gradient of the reference loss through ``model``, one unpadded sequence at a time."""
    model.zero_grad(set_to_none=True)
    t_max = max(len(t.token_ids) for t in trajs)
    rows = []
    for t in trajs:
        lp = reference_grpo.sequence_logprobs(model, list(t.token_ids))
        rows.append(torch.cat([lp, lp.new_zeros(t_max - len(lp))]))
    logprobs = torch.stack(rows)
    mask = [list(t.loss_mask) + [0] * (t_max - len(t.token_ids)) if t.trainable else [0] * t_max for t in trajs]
    rollout = [list(t.rollout_logprobs) + [0.0] * (t_max - len(t.token_ids)) for t in trajs]
    old, weights = rollout, None
    if mode != "none":
        old = logprobs.detach().tolist()
        weights, _ = ref.mismatch_weights(old, rollout, mask, mode, low, high)
    value = ref.policy_loss(loss, logprobs, old, adv, mask, *clip, agg, weights)
    value.backward()
    return grads(model), float(value.detach())


@pytest.mark.parametrize("loss,mode,agg", [
    ("gspo", "none", "seq_mean"), ("gspo", "icepop", "token_mean"), ("cispo", "none", "token_mean"),
    ("cispo", "seq_tis", "seq_mean"), ("ppo_clip", "geo_mask", "token_mean"), ("ppo_clip", "seq_reject", "seq_mean"),
])
def test_trainer_gradient_equals_the_reference(base_model, loss, mode, agg):  # noqa: F811
    trajs = rollout_batch(base_model, n=8, noise=0.4, invalid=(3,))
    adv = trajectory_advantages(trajs, estimator="rloo")
    clip = (0.05, 0.08) if loss == "gspo" else (0.2, 0.28)
    low, high = {"geo_mask": (0.9, 1.1), "seq_reject": (0.7, 1.4), "icepop": (0.8, 1.25)}.get(mode, (0.5, 1.2))
    trainer = TorchTrainer(copy.deepcopy(base_model), cfg(loss=loss, loss_agg=agg, micro_batch_size=3,
                                                          clip_eps_low=clip[0], clip_eps_high=clip[1],
                                                          mismatch={"mode": mode, "low": low, "high": high}))
    metrics = trainer.compute_gradients(collate(trajs, adv, PAD))
    expected, value = _reference_gradients(copy.deepcopy(base_model), trajs, adv.tolist(), loss, clip, agg,
                                           mode, low, high)
    ours = grads(trainer.model)
    for name, g in expected.items():
        torch.testing.assert_close(ours[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert metrics["train/pg_loss"] == pytest.approx(value, rel=1e-4, abs=1e-6)
    if mode != "none":
        for key in ("mismatch/weight_mean", "mismatch/masked_token_frac", "mismatch/clipped_token_frac",
                    "mismatch/masked_seq_frac", "mismatch/seq_log_ratio_mean"):
            assert math.isfinite(metrics[key]), key
        if mode in ("geo_mask", "seq_reject"):  # noise 0.4 on every token: a narrow band rejects sequences
            assert metrics["mismatch/masked_seq_frac"] > 0
        if mode == "icepop":
            assert 0 < metrics["mismatch/masked_token_frac"] < 1
        if mode == "seq_tis":
            assert metrics["mismatch/clipped_token_frac"] > 0


def test_off_policy_tis_alias_is_mismatch_tis(base_model):  # noqa: F811
    trajs = rollout_batch(base_model, n=8, noise=0.7)
    batch = collate(trajs, trajectory_advantages(trajs), PAD)
    old = TorchTrainer(copy.deepcopy(base_model), cfg(off_policy="tis", tis_cap=1.5))
    new = TorchTrainer(copy.deepcopy(base_model), cfg(mismatch={"mode": "tis", "high": 1.5}))
    m_old, m_new = old.compute_gradients(batch), new.compute_gradients(batch)
    g_old, g_new = grads(old.model), grads(new.model)
    for name in g_old:
        assert torch.equal(g_old[name], g_new[name]), name
    assert m_old["train/loss"] == m_new["train/loss"]
    assert m_new["mismatch/clipped_token_frac"] > 0


def test_default_trainer_is_ppo_clip_without_correction(base_model):  # noqa: F811
    c = cfg()
    assert (c.loss, c.advantage, c.mismatch.mode, c.advantage_estimator) == ("ppo_clip", "grpo", "none", "grpo")
    trajs = rollout_batch(base_model, n=4, noise=0.3)
    metrics = TorchTrainer(copy.deepcopy(base_model), c).compute_gradients(collate(trajs, trajectory_advantages(trajs), PAD))
    assert not any(k.startswith("mismatch/masked") for k in metrics)


# -- config keys --------------------------------------------------------------------------------------

def test_algorithm_keys_load_from_the_command_line():
    c = load_config("examples/tiny.yaml", ["trainer.loss=gspo", "trainer.advantage=rloo",
                                           "trainer.mismatch.mode=icepop", "trainer.mismatch.low=0.4",
                                           "rollout.overlong.mode=soft", "rollout.overlong.buffer_tokens=4"])
    assert (c.trainer.loss, c.trainer.advantage_estimator, c.trainer.mismatch.mode) == ("gspo", "rloo", "icepop")
    assert (c.trainer.mismatch.low, c.rollout.overlong.mode, c.rollout.overlong.ramp_tokens(16)) == (0.4, "soft", 4)


@pytest.mark.parametrize("overrides,match", [
    (["trainer.adv_std_normalize=false", "trainer.advantage=rloo"], "trainer.advantage=dr_grpo"),
    (["trainer.off_policy=tis", "trainer.mismatch.mode=icepop"], "set only trainer.mismatch"),
    (["trainer.mismatch.low=1.5"], "trainer.mismatch.low"),
    (["trainer.mismatch.high=0.9"], "trainer.mismatch.high"),
    (["rollout.overlong.mode=soft", "rollout.overlong.buffer_tokens=17"], "buffer_tokens=17 must be <= rollout.max_new_tokens=16"),
    (["trainer.advantage=reinforce"], "trainer.advantage"),
])
def test_bad_algorithm_keys_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("examples/tiny.yaml", overrides)


def test_the_old_keys_keep_working():
    c = load_config("examples/tiny.yaml", ["trainer.adv_std_normalize=false"])
    assert c.trainer.advantage_estimator == "dr_grpo"
    c = load_config("examples/tiny.yaml", ["trainer.off_policy=tis", "trainer.tis_cap=3.0"])
    assert (c.trainer.mismatch_in_effect.mode, c.trainer.mismatch_in_effect.high) == ("tis", 3.0)


# -- advantages over trajectories, overlong shaping ------------------------------------------------

@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_trajectory_advantages_match_the_reference(base_model, estimator):  # noqa: F811
    trajs = rollout_batch(base_model, n=12, invalid=(2, 7))
    ours = trajectory_advantages(trajs, estimator=estimator)
    groups = [t.group_id for t in trajs]
    theirs = ref.advantages(estimator, [t.reward for t in trajs], groups, [t.trainable for t in trajs],
                            [t.num_policy_tokens for t in trajs])
    assert ours.tolist() == pytest.approx(theirs, abs=1e-6)


def _episode(i: int, reply_len: int, reward: float, stop: str = "terminated", status: str = "ok"):
    t = make_traj(i, "g", [5, 6], [7] * reply_len, [-1.0] * reply_len, reward, status)
    turn = Turn(2, (7,) * reply_len, (-1.0,) * reply_len, 0, "length" if stop == "length" else "stop")
    return dataclasses.replace(t, turns=(turn,), stop_reason=stop)


def test_soft_overlong_shaping_penalises_the_last_buffer_tokens():
    trajs = [_episode(0, 8, 1.0), _episode(1, 14, 1.0), _episode(2, 16, 1.0, "length"), _episode(3, 16, 0.0, status="error")]
    ok = np.array([t.trainable for t in trajs])
    rewards, trainable, pen = overlong_shaping(trajs, np.array([1.0, 1.0, 1.0, 0.0]), ok,
                                               OverlongConfig(mode="soft", buffer_tokens=4), 16)
    assert pen.tolist() == [0.0, -0.5, -1.0, 0.0]  # the failed episode takes no penalty
    assert rewards.tolist() == [1.0, 0.5, 0.0, 0.0] and trainable.tolist() == [True, True, True, False]
    m = overlong_metrics(trajs, OverlongConfig(mode="soft", buffer_tokens=4), 16)
    assert m[OVERLONG_TRUNCATED_FRAC] == 0.25 and m[OVERLONG_PENALTY_MEAN] == pytest.approx(-0.5)


def test_mask_overlong_takes_truncated_samples_out():
    trajs = [_episode(0, 8, 1.0), _episode(1, 16, 1.0, "length"), _episode(2, 9, 0.0, "max_total_tokens")]
    ok = np.ones(3, dtype=bool)
    rewards, trainable, _ = overlong_shaping(trajs, np.array([1.0, 1.0, 0.0]), ok, OverlongConfig(mode="mask"), 16)
    assert trainable.tolist() == [True, False, False] and rewards.tolist() == [1.0, 1.0, 0.0]
    assert overlong_metrics(trajs, OverlongConfig(mode="mask"), 16)[OVERLONG_MASKED] == 2.0
    assert overlong_metrics(trajs, OverlongConfig(), 16) == {}


def test_overlong_penalty_default_buffer_is_a_quarter():
    assert OverlongConfig(mode="soft").ramp_tokens(128) == 32
    with pytest.raises(ConfigError):
        overlong_shaping([_episode(0, 8, 1.0)], np.array([1.0]), np.array([True]),
                         OverlongConfig(mode="soft", buffer_tokens=40), 16)
