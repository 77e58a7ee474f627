"""What the token record keeps of media: items split back out of a sample's concatenated arrays
(images, videos, audio clips of a tiny Qwen2.5-Omni thinker) digest as they did when processed one
by one, positions follow the placeholder runs, and media values that are not JSON data are written
so the processor gets the same arrays back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoConfig

from relax_agent.config import ModelConfig
from relax_agent.models import load_media_processor, make_tiny_media_model
from relax_agent.multimodal.parts import audio_part, image_part, video_part
from relax_agent.multimodal.record import item_digest, item_starts, json_safe_messages, media_record, split_items
from relax_agent.records import MediaInputs


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    folder = make_tiny_media_model(tmp_path_factory.mktemp("tiny-omni"), kind="tiny-omni")
    return load_media_processor(ModelConfig(path=str(folder)), AutoConfig.from_pretrained(folder))


def _img(seed, size=56):
    return np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)


def _clip(freq):
    return (0.5 * np.sin(2 * np.pi * freq * np.arange(8000) / 16000)).astype(np.float32)


def test_items_split_back_digest_as_processed_one_by_one(processor):
    parts = [image_part(_img(0)), audio_part(_clip(440.0)), video_part([_img(1), _img(2), _img(3)]),
             image_part(_img(4, 84)), audio_part(_clip(880.0))]
    items = [processor.process(p) for p in parts]
    merged = MediaInputs.concat(items)
    back = split_items(merged)
    assert [i.kinds for i in back] == [i.kinds for i in items]
    assert [item_digest(i) for i in back] == [item_digest(i) for i in items]
    assert len({item_digest(i) for i in items}) == 5
    other = processor.process(image_part(_img(5)))
    assert item_digest(other) != item_digest(items[0])


def test_starts_follow_each_kinds_placeholder_runs(processor):
    kind_of = processor.family.kind_of_token()
    img, aud = processor.family.token_ids["image"], processor.family.token_ids["audio"]
    ids = [7, img, img, 8, aud, aud, aud, 9, img, img]
    assert item_starts(ids, ["image", "audio", "image"], [2, 3, 2], kind_of) == [1, 4, 8]
    assert item_starts(ids, ["image", "image", "image"], [2, 2, 1], kind_of) is None  # too few placeholders
    media = MediaInputs.concat([processor.process(image_part(_img(0)))])
    rec = media_record(media, [img] * media.num_tokens[0], kind_of)
    assert rec["starts"] == [0] and rec["kinds"] == ["image"] and len(rec["digests"][0]) == 16
    assert media_record(media, [], None)["starts"] is None
    odd = MediaInputs(("image",), (1,), {"image_embeds": np.zeros((1, 4), np.float32)})
    assert media_record(odd, [img], kind_of)["digests"] is None  # an unknown layout: no digests, no failure


def test_media_that_are_not_json_data_are_written_so_they_process_the_same(processor):
    raw = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "image": _img(0)},
                                         {"type": "video", "video": np.stack([_img(1), _img(2)])},
                                         {"type": "audio", "audio": _clip(440.0)}]}]
    safe = json.loads(json.dumps(json_safe_messages(raw)))
    for before, after in zip(raw[0]["content"][1:], safe[0]["content"][1:], strict=True):
        assert item_digest(processor.process(before)) == item_digest(processor.process(after))
    assert safe[0]["content"][0] == {"type": "text", "text": "look"}
    assert safe[0]["content"][1]["image"].startswith("data:image/png;base64,")


def test_the_bus_trajectory_field_carries_no_media_arrays_or_routes_and_records_the_same_digests(processor):
    """The loop reads the ``trajectory`` field (metrics, dumps, token records): it holds the media as a
    summary (kinds, token counts, digests) and the turns without routes; the arrays go to the trainer
    in their own fields, and the token record written from the summary equals the one from the arrays."""
    from relax_agent import records as R

    media = MediaInputs.concat([processor.process(image_part(_img(0))), processor.process(audio_part(_clip(440.0)))])
    img = processor.family.token_ids["image"]
    n = sum(media.num_tokens)
    routes = np.ones((2, 2, 2), np.uint8)
    turn = R.Turn(n, (5, 6), (-0.1, -0.2), 0, "stop", routed_experts=routes)
    traj = R.Trajectory("g/0", "g", "t", tuple([img] * n + [5, 6]), tuple([0] * n + [1, 1]),
                        tuple([0.0] * n + [-0.1, -0.2]), n, (turn,), 1.0, media=media)
    fields = R.trajectory_fields([traj], ((2, 2), "uint8"))
    slim = fields[R.TRAJECTORY][0]
    assert slim.media.arrays == {} and slim.turns[0].routed_experts is None
    assert fields[R.MEDIA][0] is media and fields[R.ROUTED_EXPERTS][0][n:].tolist() == routes.tolist()
    kind_of = processor.family.kind_of_token()
    assert media_record(slim.media, slim.token_ids, kind_of) == media_record(media, traj.token_ids, kind_of)
    assert (slim.token_ids, slim.loss_mask, slim.turns[0].token_ids) == (traj.token_ids, traj.loss_mask, (5, 6))
