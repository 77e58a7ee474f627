"""Replay of media episodes (tiny Qwen2.5-VL, real sampling on the media engine): the token record
keeps per media item its placeholder tokens, position and digest; replay re-renders each
observation delta with its images through the processor and recomputes the log-probs with them;
a dropped image is found at its turn and first placeholder token, with its placeholders kept and
with them gone."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest

from relax_agent.control.reporting import write_token_record
from relax_agent.models import make_tiny_media_model
from relax_agent.multimodal.parts import image_part
from relax_agent.multimodal.record import split_items
from relax_agent.records import MediaInputs
from relax_agent.replay import (
    DELTA,
    LOGPROBS,
    MEDIA,
    check_deltas_and_media,
    check_logprobs,
    load_token_record,
    replay_records,
)
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.rollout.env_driver import EnvDriver
from relax_agent.rollout.parsers import HermesParser
from tests.fixtures import load_media_policy


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (56, 56, 3), dtype=np.uint8)


class LookAgain:
    """Every step shows another image (in a user message; after the first as a raw array, not a data URL);
    the episode ends after ``steps`` steps."""

    def __init__(self, steps: int = 3):
        self.steps, self.n = steps, 0

    def reset(self, seed=None, options=None):
        self.n = 0
        prompt = [{"type": "text", "text": "How many shapes?"}, image_part(_image(seed))]
        return [{"role": "user", "content": prompt}], {}

    def step(self, action):
        self.n += 1
        img = image_part(_image(100 + self.n)) if self.n == 1 else {"type": "image", "image": _image(100 + self.n)}
        obs = [{"role": "user", "content": [{"type": "text", "text": f"Look again ({self.n}):"}, img]}]
        return obs, 0.0, self.n >= self.steps, False, {}

    def close(self):
        pass


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return load_media_policy(make_tiny_media_model(tmp_path_factory.mktemp("tiny-vl"), kind="tiny-vl", seed=1))


@pytest.fixture(scope="module")
def records(policy, tmp_path_factory):
    model, tok, renderer = policy
    engine = HFEngine(model, tok, EngineConfig())
    driver = EnvDriver(LookAgain, engine, renderer, HermesParser())
    trajs = []
    for seed in (0, 1):
        spec = EpisodeSpec(f"g/{seed}", "g", "t", {}, seed=seed, max_turns=4, max_total_tokens=4096)
        trajs.append(asyncio.run(driver.play(spec, SamplingParams(6, temperature=1.0, seed=seed))))
    assert all(t.error is None and len(t.turns) == 3 and len(t.media) == 3 for t in trajs), [t.error for t in trajs]
    run = tmp_path_factory.mktemp("media_replay")
    write_token_record(run / "rollouts" / "tokens" / "step_000001.jsonl.gz", [(t, 0) for t in trajs],
                       renderer.family.kind_of_token())
    return load_token_record(run, 1)


def _image_item(rec, renderer, k):
    """(index, start, num_tokens) of the media item in the observation after turn k (1-based)."""
    m = rec["media"]
    end = rec["turns"][k - 1]["start"] + len(rec["turns"][k - 1]["token_ids"])
    j = next(j for j, s in enumerate(m["starts"]) if end <= s < rec["turns"][k]["start"])
    return j, m["starts"][j], m["num_tokens"][j]


def test_the_record_keeps_each_media_item_where_it_sits(records, policy):
    _, _, renderer = policy
    pad = renderer.family.token_ids["image"]
    for rec in records:
        m = rec["media"]
        assert m["kinds"] == ["image"] * 3 and len(set(m["digests"])) == 3
        for start, n in zip(m["starts"], m["num_tokens"], strict=True):
            assert n == 4 and rec["token_ids"][start - 1:start + n + 1] == \
                [renderer.family.vision_start_id, *[pad] * n, renderer.family.vision_end_id]
        assert rec["messages"][-1]["content"][1]["image"].startswith("data:image/png;base64,")  # an array, kept as PNG


def test_media_episodes_replay_clean_with_deltas_and_log_probs_checked(records, policy):
    model, _, renderer = policy
    reports = replay_records(records, renderer, {0: model}.get, 1.0, 2e-3)
    for rep in reports:
        assert rep.divergence is None and rep.skipped == {}, (rep.divergence, rep.skipped)
        assert rep.max_logprob_diff is not None and rep.max_logprob_diff < 2e-3
    # the log-probs see the media: the same tokens with the two observation images swapped diverge after them
    rec = records[0]
    _, _, media = check_deltas_and_media(rec, renderer)
    items = split_items(media)
    swapped = MediaInputs.concat([items[0], items[2], items[1]])
    d, worst = check_logprobs(rec, model, 1.0, 2e-3, swapped)
    assert d is not None and d.check == LOGPROBS and d.token > rec["media"]["starts"][1] and worst > 2e-3


def test_a_dropped_image_with_its_placeholders_kept_is_found_at_its_first_placeholder(records, policy):
    _, _, renderer = policy
    rec = copy.deepcopy(records[0])
    j, start, _ = _image_item(rec, renderer, 2)  # the image of the observation after turn 2
    for key in ("kinds", "num_tokens", "digests", "starts"):
        del rec["media"][key][j]
    rec["media_kinds"] = rec["media"]["kinds"]
    (rep,) = replay_records([rec], renderer, None, 1.0, 2e-3)
    d = rep.divergence
    assert (d.check, d.turn, d.token) == (MEDIA, 2, start)
    assert d.expected == f"image of 4 tokens (digest {records[0]['media']['digests'][j]})" and d.recorded is None


def test_a_dropped_image_with_its_placeholders_gone_is_found_at_its_first_placeholder(records, policy):
    _, _, renderer = policy
    rec = copy.deepcopy(records[1])
    j, start, n = _image_item(rec, renderer, 1)  # the image of the observation after turn 1
    for key in ("token_ids", "loss_mask", "rollout_logprobs"):
        del rec[key][start:start + n]
    for t in rec["turns"][1:]:
        t["start"] -= n
    for key in ("kinds", "num_tokens", "digests", "starts"):
        del rec["media"][key][j]
    (rep,) = replay_records([rec], renderer, None, 1.0, 2e-3)
    d = rep.divergence
    assert (d.check, d.turn, d.token) == (DELTA, 1, start)
    assert (d.expected, d.recorded) == (renderer.family.token_ids["image"], renderer.family.vision_end_id)


def test_a_dropped_prompt_image_and_other_pixels_are_found(records, policy):
    model, _, renderer = policy
    rec = copy.deepcopy(records[0])
    first = rec["media"]["starts"][0]
    rec["media"]["digests"][0] = "0" * 16  # the trainer got other pixels for the prompt's image
    (rep,) = replay_records([rec], renderer, {0: model}.get, 1.0, 2e-3)
    assert (rep.divergence.check, rep.divergence.turn, rep.divergence.token) == (MEDIA, None, first)
    assert LOGPROBS not in rep.skipped or "media" in rep.skipped[LOGPROBS]


def test_a_media_episode_replayed_with_a_text_renderer_is_skipped_with_the_reason(policy):
    _, tok, _ = policy
    rec = {"turns": [{}, {}], "media_kinds": ["image"], "media": {"digests": ["d0"]}}
    text_renderer = ChatRenderer(tok)
    divergence, reason, media = check_deltas_and_media(rec, text_renderer)
    assert (divergence, media) == (None, None)
    assert reason == "media episode replayed with a text renderer (the policy's config is not multimodal)"
