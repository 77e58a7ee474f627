"""R3 for a multimodal MoE policy (tiny Qwen3-VL-MoE): the text decoder's routers are found, the
media engine records the experts of every token of a two-turn episode (prompt, media tokens, the
tool's image, sampled tokens), and the trainer, fed the media, replays them: its log-probs of the
rollout tokens are the rollout's and no route flips; forced routes at the media tokens are applied."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import numpy as np
import pytest
import torch

from relax_agent import records as R
from relax_agent.models import make_tiny_media_model
from relax_agent.moe import REPLAYED_TOKENS, ROUTE_FLIP_FRAC, find_routers, replay_weights
from relax_agent.multimodal.batch import media_model_kwargs
from relax_agent.multimodal.parts import image_part, video_part
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.rollout.env_driver import EnvDriver
from relax_agent.rollout.parsers import HermesParser
from relax_agent.train.algorithms import MISMATCH_ABS_DIFF_MAX
from relax_agent.train.backends.torch_backend import TorchTrainer
from relax_agent.train.batch import TrainBatch
from relax_agent.train.collate import collate_fields
from relax_agent.train.config import TrainerConfig
from tests.fixtures import load_media_policy


def _image(seed: int, h: int = 64, w: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


class ImageToolEnv:
    """Two turns: an image and a video in the prompt; after the first reply a tool message with an image."""

    def reset(self, seed=None, options=None):
        self.turn = 0
        video = video_part([_image(1), _image(2), _image(3)])
        return [{"role": "user", "content": [{"type": "text", "text": "Count the shapes."}, image_part(_image(0)),
                                             video]}], {}

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return [{"role": "tool", "content": [{"type": "text", "text": "zoomed"}, image_part(_image(4, 32, 32))]}], \
                0.0, False, False, {}
        return [], 1.0, True, False, {}

    def close(self):
        pass


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return load_media_policy(make_tiny_media_model(tmp_path_factory.mktemp("vl3moe"), kind="tiny-vl3-moe", seed=3))


@pytest.fixture(scope="module")
def episode(policy):
    """A two-turn episode played by the media engine (fp32, its own copy of the weights, recording routes)."""
    model, tok, renderer = policy
    engine = HFEngine(copy.deepcopy(model), tok, EngineConfig(), record_routes=True)
    spec = EpisodeSpec("g/0", "g", "t", {}, seed=0, max_turns=2, max_total_tokens=4096)
    try:
        traj = asyncio.run(EnvDriver(ImageToolEnv, engine, renderer, HermesParser()).play(spec, SamplingParams(6)))
    finally:
        engine.close()
    assert traj.error is None and len(traj.turns) == 2 and traj.media.kinds == ("image", "video", "image")
    return traj, engine.route_layout


def test_the_text_decoders_routers_are_found_and_their_weights_reproduced(policy):
    model, _, _ = policy
    routers = find_routers(model)
    assert [r.name for r in routers] == [f"model.language_model.layers.{i}.mlp.gate" for i in range(2)]
    assert all((r.num_experts, r.top_k, r.renormalize, r.weights_in_logits_dtype) == (8, 2, True, True) for r in routers)
    logits, weights, indices = routers[0].module(torch.randn(16, 64))
    assert torch.equal(replay_weights(logits, indices, routers[0]), weights)  # own experts: the model's own weights
    other = (indices + 1) % 8
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, other)
    torch.testing.assert_close(replay_weights(logits, other, routers[0]), probs / probs.sum(-1, keepdim=True))


def test_every_token_but_the_first_has_routes_media_tokens_included(episode, policy):
    traj, layout = episode
    _, _, renderer = policy
    assert layout == ((2, 2), "uint8")
    n = len(traj.token_ids)
    assert traj.routes_mask.tolist() == [False] + [True] * (n - 1)
    first, second = traj.turns
    assert first.context_start == 1 and len(first.context_routed_experts) == first.start - 1
    # the second turn's prefill routed what came after the first turn: the tool message with its image
    assert second.context_start == first.start + len(first.token_ids) and len(second.context_routed_experts) > 0
    ids = np.asarray(traj.token_ids)
    media_rows = np.isin(ids, list(renderer.family.token_ids.values()))
    assert media_rows[second.context_start:second.start].sum() == traj.media.num_tokens[2]  # the tool image's tokens
    routes = traj.routed_experts
    assert routes.shape == (n, 2, 2) and routes.dtype == np.uint8 and int(routes.max()) < 8
    assert all(len(set(row)) == 2 for row in routes[1:].reshape(-1, 2).tolist())  # distinct experts per layer


def _expert_choices(model):
    """Per MoE layer, the expert indices [N, k] handed to ``mlp.experts`` in each forward."""
    seen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            layer = []
            seen.append(layer)
            module.register_forward_pre_hook(lambda _m, args, layer=layer: layer.append(args[1].detach().clone()))
    return seen


def test_recorded_routes_are_the_routers_choice_at_the_previous_position(episode, policy):
    traj, _ = episode
    model = copy.deepcopy(policy[0])
    seen = _expert_choices(model)
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        model(input_ids=ids, **media_model_kwargs(model, policy[2].family, ids, [traj.media]))
    for layer, choices in enumerate(seen):
        own = choices[0].sort(dim=-1).values  # [T, k]: position q's experts
        recorded = torch.from_numpy(traj.routed_experts[1:, layer].astype(np.int64)).sort(dim=-1).values
        assert torch.equal(own[:-1], recorded)  # token t's route is position t - 1's choice, for every t


def _batch(traj, layout) -> TrainBatch:
    fields = R.trajectory_fields([traj], layout)
    return collate_fields({**fields, R.ADVANTAGE: np.asarray([1.0], np.float32)}, pad_token_id=0)


def test_replay_reproduces_the_rollout_logprobs_with_the_media_fed(episode, policy):
    traj, layout = episode
    model = copy.deepcopy(policy[0])
    trainer = TorchTrainer(model, TrainerConfig(micro_batch_size=1), routing_replay=True)
    metrics = trainer.compute_gradients(_batch(traj, layout))
    assert metrics[MISMATCH_ABS_DIFF_MAX] < 1e-5
    assert metrics[ROUTE_FLIP_FRAC] == 0.0
    assert metrics[REPLAYED_TOKENS] == len(traj.token_ids) - 1  # every position but the last one
    visual = [p for n, p in model.named_parameters() if ".visual." in f".{n}"]
    assert sum(float(p.grad.abs().sum()) for p in visual if p.grad is not None) > 0  # the encoder still trains
    for router in find_routers(model):
        assert router.module.weight.grad is not None and router.module.weight.grad.abs().sum() > 0


def test_forced_routes_at_the_media_tokens_are_applied(episode, policy):
    traj, layout = episode
    batch = _batch(traj, layout)
    media = torch.isin(batch.input_ids, torch.tensor(list(policy[2].family.token_ids.values())))
    forced = batch.routed_experts.clone()
    forced[media] = (forced[media] + 3) % 8  # experts the routers did not pick, at the media tokens only
    trainer = TorchTrainer(copy.deepcopy(policy[0]), TrainerConfig(micro_batch_size=1), routing_replay=True)
    seen = _expert_choices(trainer.model)
    metrics = trainer.compute_gradients(dataclasses.replace(batch, routed_experts=forced))
    for layer, choices in enumerate(seen):
        assert len(choices) == 1  # one forward
        ran = choices[0].sort(dim=-1).values
        assert torch.equal(ran[:-1], forced[0, 1:, layer].long().sort(dim=-1).values)  # every position ran its route
    # each media token's route differs from its position's own choice (more may flip downstream)
    assert metrics[ROUTE_FLIP_FRAC] >= int(media.sum()) / (len(traj.token_ids) - 1)
    assert metrics[MISMATCH_ABS_DIFF_MAX] > 1e-4  # the policy tokens after the media saw other experts run
