"""R3 routing replay with tiny random Qwen3-MoE / Mixtral / OLMoE models: record, collate, replay."""

from __future__ import annotations

import copy
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from relax_agent.config import EngineConfig, ModelConfig, TrainerConfig, load_config
from relax_agent.errors import ConfigError, DataError
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.moe import ROUTE_FLIP_FRAC, find_routers, replay_weights, route_dtype
from relax_agent.records import Trajectory, Turn
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.train.algorithms import (
    MISMATCH_ABS_DIFF_MAX,
    MISMATCH_ABS_DIFF_MEAN,
    MISMATCH_FRAC_GT_LN2,
    MISMATCH_FRAC_GT_LN5,
    MISMATCH_K3_KL,
)
from relax_agent.train.backends.torch_backend import TorchTrainer
from relax_agent.train.batch import TrainBatch, collate

ARCHS = ("qwen3_moe", "mixtral", "olmoe")
OBSERVATION = [27, 91, 318, 62, 3327, 7469]
"""Token ids standing for an observation's chat-template delta between two turns."""


@pytest.fixture(scope="module", params=ARCHS)
def moe_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0)


def load(model_dir, dtype="fp32"):
    return load_policy(ModelConfig(path=str(model_dir)), dtype=dtype)


def turn_of(start: int, gen) -> Turn:
    return Turn(start, gen.token_ids, gen.logprobs, gen.policy_version, gen.finish_reason, gen.routed_experts)


def make_trajectory(sample_id: str, prompt: list[int], turns: list[Turn], tail: list[int]) -> Trajectory:
    """prompt, then each turn's tokens, with ``tail`` tokens between turns (observations)."""
    ids, mask, lps = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
    for i, turn in enumerate(turns):
        assert turn.start == len(ids)
        ids += turn.token_ids
        mask += [1] * len(turn.token_ids)
        lps += turn.logprobs
        if i + 1 < len(turns):
            ids += tail
            mask += [0] * len(tail)
            lps += [0.0] * len(tail)
    return Trajectory(sample_id, "g", "t", tuple(ids), tuple(mask), tuple(lps), len(prompt), tuple(turns), 1.0)


@pytest.fixture(scope="module")
def rollouts(moe_dir):
    """Trajectories from the engine (fp32, record_routes): two single-turn, one two-turn episode."""
    model, tok = load(moe_dir)
    prompts = [[1, 504, 2116, 30, 1536], [1, 42, 43], [1, 900, 901, 902, 903, 904, 905, 906]]
    with HFEngine(model, tok, EngineConfig(max_batch_size=8), record_routes=True) as engine:
        first = engine.generate_many(prompts, [SamplingParams(max_new_tokens=10, seed=s) for s in range(3)])
        ctx = prompts[2] + list(first[2].token_ids) + OBSERVATION
        second = engine.generate_many([ctx], SamplingParams(max_new_tokens=8, seed=9))[0]
    trajs = [make_trajectory(f"s{i}", p, [turn_of(len(p), g)], []) for i, (p, g) in enumerate(zip(prompts[:2], first[:2], strict=True))]
    p = prompts[2]
    trajs.append(make_trajectory("s2", p, [turn_of(len(p), first[2]), turn_of(len(ctx), second)], OBSERVATION))
    return trajs


def batch_of(trajs) -> TrainBatch:
    return collate(trajs, [1.0, -0.5, 0.5][: len(trajs)], pad_token_id=0)


def trainer_for(model_dir, replay=True, **cfg) -> TorchTrainer:
    model, _ = load(model_dir)
    return TorchTrainer(model, TrainerConfig(micro_batch_size=2, lr=1e-4, **cfg), routing_replay=replay)


def capture_expert_choices(model: nn.Module) -> tuple[list[list[torch.Tensor]], list]:
    """Per MoE layer, the expert indices handed to ``mlp.experts`` in each forward pass."""
    seen: list[list[torch.Tensor]] = []
    handles = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            layer: list[torch.Tensor] = []
            seen.append(layer)
            handles.append(module.register_forward_pre_hook(lambda _m, args, layer=layer: layer.append(args[1].detach().clone())))
    return seen, handles


# -- recording -------------------------------------------------------------------------------


def test_engine_records_one_route_per_sampled_token(rollouts, moe_dir):
    routers = find_routers(load(moe_dir)[0])
    for traj in rollouts:
        for turn in traj.turns:
            r = turn.routed_experts
            assert r.dtype == np.uint8 and r.shape == (len(turn.token_ids), len(routers), routers[0].top_k)
            assert int(r.max()) < routers[0].num_experts
            assert all(len(set(row)) == len(row) for row in r.reshape(-1, r.shape[-1]).tolist())  # distinct experts
        full = traj.routed_experts
        assert full.shape[0] == len(traj.token_ids)
        assert np.array_equal(traj.routes_mask, np.array(traj.loss_mask, dtype=bool))
        assert not full[~traj.routes_mask].any()


def test_recorded_routes_are_those_of_the_forward_that_scored_each_token(rollouts, moe_dir):
    """Route of token t == the router's choice at position t - 1 in a plain forward pass over the sequence."""
    model, _ = load(moe_dir)
    seen, _ = capture_expert_choices(model)
    traj = rollouts[0]
    with torch.no_grad():
        model(torch.tensor([traj.token_ids]))
    n = len(traj.token_ids)
    for layer, choices in enumerate(seen):
        own = choices[0].view(n, -1)
        for t in np.nonzero(traj.routes_mask)[0]:
            assert sorted(own[t - 1].tolist()) == sorted(traj.routed_experts[t, layer].tolist())


def test_route_dtype_is_compact():
    assert route_dtype(8) == np.uint8 and route_dtype(256) == np.uint8
    assert route_dtype(257) == np.int16 and route_dtype(40000) == np.int32


# -- collation --------------------------------------------------------------------------------


def test_collate_pads_routes_and_split_slices_them(rollouts):
    batch = batch_of(rollouts)
    b, t = batch.input_ids.shape
    assert batch.routed_experts.dtype == torch.uint8 and batch.routed_experts.shape[:2] == (b, t)
    assert torch.equal(batch.routes_mask, batch.loss_mask)
    for i, traj in enumerate(rollouts):
        n = len(traj.token_ids)
        assert np.array_equal(batch.routed_experts[i, :n].numpy(), traj.routed_experts)
        assert not batch.routes_mask[i, n:].any()
    parts = batch.split(2)
    assert sum(p.size for p in parts) == b
    assert torch.equal(parts[1].routed_experts[0], batch.routed_experts[2, : parts[1].input_ids.shape[1]])
    assert batch.to("cpu").routed_experts is not None


def test_collate_without_routes_and_mismatched_routes(rollouts):
    plain = [Trajectory("a", "g", "t", (1, 2, 3), (0, 1, 1), (0.0, -1.0, -1.0), 1,
                        (Turn(1, (2, 3), (-1.0, -1.0), 0, "stop"),), 1.0)]
    batch = collate(plain, [1.0], pad_token_id=0)
    assert batch.routed_experts is None and batch.routes_mask is None and batch.to("cpu").routes_mask is None
    turn = rollouts[0].turns[0]
    odd = Turn(turn.start, turn.token_ids, turn.logprobs, 0, "stop", turn.routed_experts[:, :1])
    bad = make_trajectory("x", list(rollouts[0].token_ids[: turn.start]), [odd], [])
    with pytest.raises(DataError, match="different"):
        collate([rollouts[0], bad], [1.0, 1.0], pad_token_id=0)
    with pytest.raises(DataError, match="both"):
        TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.rollout_logprobs, batch.advantages,
                   routed_experts=torch.zeros(1, 3, 2, 2, dtype=torch.uint8))


# -- replay -----------------------------------------------------------------------------------


def test_replay_reproduces_the_engine_logprobs(rollouts, moe_dir):
    metrics = trainer_for(moe_dir).compute_gradients(batch_of(rollouts))
    assert metrics[MISMATCH_ABS_DIFF_MAX] < 1e-5
    assert metrics[ROUTE_FLIP_FRAC] == 0.0  # fp32 both sides: replay changed nothing


def test_trainer_uses_the_replayed_experts_in_every_layer_and_router_gets_gradients(rollouts, moe_dir):
    batch = batch_of(rollouts)
    forced = batch.routed_experts.clone()
    forced[batch.routes_mask] = (forced[batch.routes_mask] + 3) % 8  # experts the router would not pick
    batch = TrainBatch(**{**batch.__dict__, "routed_experts": forced})
    trainer = trainer_for(moe_dir)
    seen, _ = capture_expert_choices(trainer.model)
    metrics = trainer.compute_gradients(batch)
    assert metrics[ROUTE_FLIP_FRAC] == 1.0
    assert metrics[MISMATCH_ABS_DIFF_MAX] > 1e-3  # other experts really ran
    replayed = torch.cat([batch.routes_mask[:, 1:], torch.zeros_like(batch.routes_mask[:, :1])], dim=1)
    own, _ = capture_expert_choices(base := load(moe_dir)[0])
    with torch.no_grad():
        for micro in batch.split(2):
            base(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
    for layer, (choices, plain) in enumerate(zip(seen, own, strict=True)):
        assert len(choices) == 2  # one forward per micro-batch
        for (micro, got, mine), rows in zip(zip(batch.split(2), choices, plain, strict=True), (slice(0, 2), slice(2, 3)), strict=True):
            t = micro.input_ids.shape[1]
            got, mine = got.view(micro.size, t, -1), mine.view(micro.size, t, -1)
            want = torch.cat([forced[rows, 1:t, layer], forced[rows, :1, layer]], dim=1).long()
            mask = replayed[rows, :t]
            assert torch.equal(got[mask], want[mask])  # replayed positions: the recorded experts, in order
            assert torch.equal(got[~mask], mine[~mask])  # other positions: the trainer's own routing
    for router in find_routers(trainer.model):
        grad = router.module.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_weights_follow_each_family_normalisation(arch, tmp_path):
    model, _ = load(make_tiny_model(tmp_path, arch=arch, seed=1))
    router = find_routers(model)[0]
    hidden = torch.randn(16, model.config.hidden_size)
    logits, weights, indices = router.module(hidden)
    assert torch.equal(replay_weights(logits, indices, router), weights)  # own experts: the model's own weights
    other = (indices + 1) % router.num_experts
    got = replay_weights(logits, other, router)
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, other)
    renormalised = arch == "mixtral" or bool(model.config.norm_topk_prob)
    assert renormalised == (arch != "olmoe")  # the tiny configs cover both normalisations
    torch.testing.assert_close(got.float(), probs / probs.sum(-1, keepdim=True) if renormalised else probs)


def test_replay_needs_routes_that_fit_the_model(rollouts, moe_dir):
    trainer = trainer_for(moe_dir)
    batch = batch_of(rollouts)
    plain = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.rollout_logprobs, batch.advantages)
    with pytest.raises(DataError, match="no routed_experts"):
        trainer.compute_gradients(plain)
    wrong = TrainBatch(**{**batch.__dict__, "routed_experts": batch.routed_experts[:, :, :1]})
    with pytest.raises(DataError, match="layers"):
        trainer.compute_gradients(wrong)
    too_big = TrainBatch(**{**batch.__dict__, "routed_experts": batch.routed_experts + 100})
    with pytest.raises(DataError, match="expert id"):
        trainer.compute_gradients(too_big)


@pytest.mark.parametrize("moe_dir", ["qwen3_moe"], indirect=True)  # one family is enough here
def test_replay_off_leaves_moe_training_alone(rollouts, moe_dir):
    trainer = trainer_for(moe_dir, replay=False)
    assert trainer.routing_replay is None
    metrics = trainer.compute_gradients(batch_of(rollouts))
    assert ROUTE_FLIP_FRAC not in metrics and metrics[MISMATCH_ABS_DIFF_MAX] < 1e-5


# -- dense models and unsupported families ------------------------------------------------------


def test_dense_model_is_untouched(tiny_model_dir):
    model, tok = load(tiny_model_dir)
    with pytest.warns(UserWarning, match="dense"):
        engine = HFEngine(model, tok, EngineConfig(), record_routes=True)
    with engine:
        gen = engine.generate_many([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))[0]
    assert gen.routed_experts is None
    traj = make_trajectory("d", [1, 2, 3], [turn_of(3, gen)], [])
    batch = collate([traj], [1.0], pad_token_id=0)
    with pytest.warns(UserWarning, match="routing_replay=rollout is ignored"):
        on = TorchTrainer(copy.deepcopy(model), TrainerConfig(), routing_replay=True)
    off = TorchTrainer(copy.deepcopy(model), TrainerConfig())
    assert on.routing_replay is None
    metrics = on.compute_gradients(batch)
    assert metrics == off.compute_gradients(batch)
    assert {MISMATCH_K3_KL, MISMATCH_ABS_DIFF_MEAN, MISMATCH_ABS_DIFF_MAX, MISMATCH_FRAC_GT_LN2,
            MISMATCH_FRAC_GT_LN5} <= set(metrics)  # logged for dense policies too
    assert not any(key.startswith("moe/") for key in metrics)
    for a, b in zip(on.model.parameters(), off.model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_unsupported_moe_family_is_a_config_error():
    model = nn.Linear(2, 2)
    model.config = types.SimpleNamespace(model_type="deepseek_v9", num_experts=4)
    with pytest.raises(ConfigError, match="deepseek_v9.*routing_replay=off"):
        find_routers(model)
    model.config = types.SimpleNamespace(model_type="llama")
    assert find_routers(model) == []


def test_moe_config_section():
    assert load_config().moe.routing_replay == "off" and not load_config().moe.replay
    assert load_config(None, ["moe.routing_replay=rollout"]).moe.replay
    with pytest.raises(ConfigError, match="moe.routing_replay"):
        load_config(None, ["moe.routing_replay=on"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["moe.routing_replay=off"])


@pytest.mark.parametrize("moe_dir", ["qwen3_moe"], indirect=True)  # one family is enough here
def test_replay_with_activation_checkpointing_gives_the_same_step(rollouts, moe_dir):
    batch = batch_of(rollouts)
    forced = batch.routed_experts.clone()
    forced[batch.routes_mask] = (forced[batch.routes_mask] + 1) % 8
    batch = TrainBatch(**{**batch.__dict__, "routed_experts": forced})
    plain, ckpt = trainer_for(moe_dir), trainer_for(moe_dir)
    ckpt.model.activation_checkpointing_enable()  # the backward pass recomputes (and replays) each layer's forward
    calls = []
    find_routers(ckpt.model)[0].module.register_forward_hook(lambda *_: calls.append(1))
    a, b = plain.compute_gradients(batch), ckpt.compute_gradients(batch)
    assert len(calls) == 4  # 2 micro-batches, each forward once and recomputed once
    assert a[ROUTE_FLIP_FRAC] == b[ROUTE_FLIP_FRAC] == 1.0 and a["moe/replayed_tokens"] == b["moe/replayed_tokens"]
    assert a[MISMATCH_ABS_DIFF_MAX] == pytest.approx(b[MISMATCH_ABS_DIFF_MAX], abs=1e-6)
    for (name, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_public_names_resolve():
    import relax_agent.moe as moe

    for name in moe.__all__:
        assert getattr(moe, name) is not None
    with pytest.raises(AttributeError):
        moe.nope  # noqa: B018
