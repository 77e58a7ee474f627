"""The policy is not blind: with media on the batch the trainer's forward runs the encoders
(non-zero vision / audio encoder gradients), changing the image or the clip changes the
log-probs, the media engine's log-probs are the trainer's, and micro-batching keeps each row's media;
per family (tiny Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-Omni thinker)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from relax_agent.models import make_tiny_media_model
from relax_agent.multimodal.parts import audio_part, image_part
from relax_agent.records import MEDIA, MediaInputs
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.train.backends.torch_backend import TorchTrainer, token_logprobs
from relax_agent.train.batch import TrainBatch
from relax_agent.train.collate import collate_fields
from relax_agent.train.config import TrainerConfig
from tests.fixtures import load_media_policy


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-vl3", "tiny-vl3-moe", "tiny-omni"])
def policy(request, tmp_path_factory):
    folder = make_tiny_media_model(tmp_path_factory.mktemp(request.param), kind=request.param, seed=1)
    return (request.param, *load_media_policy(folder))


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (56, 56, 3), dtype=np.uint8)


def _clip(freq: float) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * freq * np.arange(16000) / 16000)


def _prompt(renderer, kind: str, image_seed: int = 0, freq: float = 440.0):
    parts = [{"type": "text", "text": "How many?"}, image_part(_image(image_seed))]
    if kind == "tiny-omni":
        parts.append(audio_part(_clip(freq)))
    return renderer.render_prompt([{"role": "user", "content": parts}])


def _answer_ids(tok) -> list[int]:
    return tok("Answer: 3", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]


def _logprobs(model, tok, seg) -> torch.Tensor:
    ids = torch.tensor([[*seg.token_ids, *_answer_ids(tok)]])
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids), media=[seg.media])[0, len(seg.token_ids):]


def test_changing_the_image_changes_the_logprobs(policy):
    kind, model, tok, r = policy
    a, b = _logprobs(model, tok, _prompt(r, kind, 0)), _logprobs(model, tok, _prompt(r, kind, 1))
    assert torch.equal(_logprobs(model, tok, _prompt(r, kind, 0)), a)  # deterministic
    assert (a - b).abs().max() > 1e-4, "the log-probs did not depend on the image: the policy is blind"


def test_changing_the_audio_changes_the_logprobs(policy):
    kind, model, tok, r = policy
    if kind != "tiny-omni":
        pytest.skip("tiny-vl takes no audio")
    a, b = _logprobs(model, tok, _prompt(r, kind, freq=440.0)), _logprobs(model, tok, _prompt(r, kind, freq=1500.0))
    assert (a - b).abs().max() > 1e-4, "the log-probs did not depend on the audio clip"


def test_without_media_the_forward_refuses_the_placeholders(policy):
    kind, model, tok, r = policy
    seg = _prompt(r, kind)
    ids = torch.tensor([list(seg.token_ids)])
    with pytest.raises(Exception, match="placeholder tokens in token_ids but its media has 0 image"):
        token_logprobs(model, ids, torch.ones_like(ids), media=[MediaInputs((), (), {})])


def _fields(r, tok, kind, rows):
    """Bus fields of prompts + a sampled answer, like a rollout writes them."""
    segs = [_prompt(r, kind, image_seed=i, freq=300.0 + 200 * i) for i in range(rows)]
    ans = _answer_ids(tok)
    return {
        "token_ids": [np.asarray([*s.token_ids, *ans]) for s in segs],
        "loss_mask": [np.asarray([0] * len(s.token_ids) + [1] * len(ans), np.int8) for s in segs],
        "rollout_logprobs": [np.zeros(len(s.token_ids) + len(ans), np.float32) for s in segs],
        "advantage": np.asarray([1.0, -1.0, 0.5][:rows], np.float32),
        MEDIA: [s.media for s in segs],
    }


def test_the_encoders_get_gradients_from_the_policy_loss(policy):
    kind, model, tok, r = policy
    batch = collate_fields(_fields(r, tok, kind, 3), tok.pad_token_id)
    assert isinstance(batch, TrainBatch) and batch.media is not None and len(batch.media) == 3
    trainer = TorchTrainer(model, TrainerConfig(micro_batch_size=2))
    trainer.compute_gradients(batch)
    towers = {"visual": [p for n, p in model.named_parameters() if ".visual." in f".{n}"]}
    if kind == "tiny-omni":
        towers["audio"] = [p for n, p in model.named_parameters() if "audio_tower" in n]
    for name, params in towers.items():
        assert params, f"no {name} encoder parameters found"
        norm = sum(float(p.grad.abs().sum()) for p in params if p.grad is not None)
        assert norm > 0, f"the {name} encoder got no gradient: the policy is blind to it"
    trainer.optimizer.zero_grad(set_to_none=True)


def test_micro_batches_keep_each_rows_media(policy):
    kind, model, tok, r = policy
    batch = collate_fields(_fields(r, tok, kind, 3), tok.pad_token_id)
    whole = TorchTrainer(model, TrainerConfig(micro_batch_size=3))
    whole.compute_gradients(batch)
    g_whole = torch.cat([p.grad.flatten() for p in whole.params if p.grad is not None]).clone()
    whole.optimizer.zero_grad(set_to_none=True)
    split = TorchTrainer(model, TrainerConfig(micro_batch_size=1))
    assert [len(m.media) for m in batch.split(1)] == [1, 1, 1]
    split.compute_gradients(batch)
    g_split = torch.cat([p.grad.flatten() for p in split.params if p.grad is not None])
    split.optimizer.zero_grad(set_to_none=True)
    assert torch.allclose(g_whole, g_split, atol=1e-5, rtol=1e-4)


def test_engine_logprobs_are_the_trainers_with_media(policy):
    kind, model, tok, r = policy
    seg = _prompt(r, kind)
    engine = HFEngine(model, tok, EngineConfig())
    try:
        gen = asyncio.run(engine.generate(list(seg.token_ids), SamplingParams(max_new_tokens=6, seed=3), media=seg.media))
        again = asyncio.run(engine.generate(list(seg.token_ids), SamplingParams(max_new_tokens=6, seed=3), media=seg.media))
    finally:
        engine.close()
    assert gen.token_ids == again.token_ids  # seeded per request
    ids = torch.tensor([[*seg.token_ids, *gen.token_ids]])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), media=[seg.media])[0, len(seg.token_ids):]
    assert torch.allclose(lp, torch.tensor(gen.logprobs), atol=1e-4)
