"""The supervised warm-up of a multimodal policy: demonstrations are the prompt an episode renders
(media expanded, the prompt's :class:`MediaInputs` on the row) plus the env's reference answer, and
an SFT step on them trains through the vision encoder."""

from __future__ import annotations

import copy

import gymnasium
import numpy as np
import pytest
import torch

import relax_agent.envs  # noqa: F401
from relax_agent.config import ModelConfig
from relax_agent.models import load_media_processor, load_policy, make_tiny_media_model
from relax_agent.multimodal.render import MediaRenderer
from relax_agent.records import MEDIA
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.demonstrations import demonstration_fields
from relax_agent.rollout.parsers import build_parser
from relax_agent.train.backends.torch_backend import TorchTrainer, token_logprobs
from relax_agent.train.batch import TrainBatch
from relax_agent.train.collate import collate_fields
from relax_agent.train.config import TrainerConfig

ENVS = {"relax/VisualCount-v0": "tiny-vl", "relax/VideoMotion-v0": "tiny-vl", "relax/AudioTones-v0": "tiny-omni"}


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    out = {}
    for kind in sorted(set(ENVS.values())):
        cfg = ModelConfig(path=str(make_tiny_media_model(tmp_path_factory.mktemp(kind), kind=kind, seed=0)))
        model, tok = load_policy(cfg)
        out[kind] = model, tok, MediaRenderer(ChatRenderer(tok, accepts_media=True), load_media_processor(cfg, model.config))
    return out


@pytest.mark.parametrize("env_id", sorted(ENVS))
def test_media_demonstrations_are_the_episode_prompt_with_its_media_plus_a_correct_answer(env_id, policies):
    _, tok, renderer = policies[ENVS[env_id]]
    env = gymnasium.make(env_id)
    tasks = env.unwrapped.tasks("train")[:3]
    demos = demonstration_fields(lambda: gymnasium.make(env_id), renderer, build_parser("hermes"), tasks, seed=0)
    assert demos["task_id"] == [t["id"] for t in tasks]
    for task, ids, mask, media in zip(tasks, demos["token_ids"], demos["loss_mask"], demos[MEDIA], strict=True):
        obs, info = env.reset(seed=0, options={"task": task})
        seg = renderer.render_prompt(obs, info.get("tools", ()))  # what the env driver records for the prompt
        n = len(seg.token_ids)
        assert list(ids[:n]) == list(seg.token_ids) and not mask[:n].any() and mask[n:].all()
        assert media.kinds == seg.media.kinds and media.num_tokens == seg.media.num_tokens and len(media) == 1
        assert sorted(media.arrays) == sorted(seg.media.arrays)
        for key, value in seg.media.arrays.items():
            np.testing.assert_array_equal(media.arrays[key], value)
        assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
        text = tok.decode(ids[n:], skip_special_tokens=True)
        assert text == f"Answer: {task['answer']}"
        env.reset(seed=0, options={"task": task})
        _, reward, terminated, _, step_info = env.step({"role": "assistant", "content": text})
        assert (reward, terminated, step_info["correct"]) == (1.0, True, 1.0)  # the env judges it correct


class _RecordingTrainer(TorchTrainer):
    """Keeps the vision encoder's gradient of each SFT step (read before clipping)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.visual_grads: list[float] = []

    def _clip_sft_grads(self) -> float:
        params = [p for n, p in self.model.named_parameters() if ".visual." in f".{n}"]
        assert params, "no vision encoder parameters found"
        self.visual_grads.append(sum(float(p.grad.abs().sum()) for p in params if p.grad is not None))
        return super()._clip_sft_grads()


def _nll(model, batch) -> float:
    """Token-mean NLL of the batch's loss tokens with each row's media."""
    model.eval()
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, media=batch.media)
    return float(-(logp * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_a_media_sft_step_lowers_the_demonstrations_nll_through_the_vision_encoder(policies):
    model, tok, renderer = policies["tiny-vl"]
    model = copy.deepcopy(model)
    env_id = "relax/VisualCount-v0"
    tasks = gymnasium.make(env_id).unwrapped.tasks("train")[:8]
    demos = demonstration_fields(lambda: gymnasium.make(env_id), renderer, build_parser("hermes"), tasks, seed=0)
    batch = collate_fields(demos, tok.pad_token_id, advantages=[1.0] * len(tasks))
    assert isinstance(batch, TrainBatch) and batch.media is not None and all(m.kinds == ("image",) for m in batch.media)
    reply = len(tok("Answer: 1", add_special_tokens=False)["input_ids"]) + 1  # one digit, then <|im_end|>
    trainer = _RecordingTrainer(model, TrainerConfig(micro_batch_size=4))
    before = _nll(model, batch)
    # the loss reads the images: the same tokens with the rows' images rotated score differently
    rotated = collate_fields({**demos, MEDIA: demos[MEDIA][1:] + demos[MEDIA][:1]}, tok.pad_token_id,
                             advantages=[1.0] * len(tasks))
    assert torch.equal(rotated.input_ids, batch.input_ids) and _nll(model, batch) == before  # deterministic
    assert _nll(model, rotated) != before
    first = trainer.sft_step(batch, 3e-3)
    assert first["sft/tokens"] == 8 * reply
    assert first["sft/loss"] == pytest.approx(before, rel=1e-4)  # the NLL before the update
    assert first["sft/grad_norm"] > 0 and trainer.visual_grads[0] > 0, "the vision encoder got no gradient"
    losses = [trainer.sft_step(batch, 3e-3)["sft/loss"] for _ in range(4)]
    after = _nll(model, batch)
    assert losses[-1] < losses[0] < first["sft/loss"] and after < before - 1.0, (before, losses, after)
    assert all(g > 0 for g in trainer.visual_grads)
