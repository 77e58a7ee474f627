"""The media examples train through the CLI (tiny-vl / tiny-omni / tiny-vl3-moe, 2 steps each), and
media go the whole way: rollout -> data bus -> trainer (the encoder's weights change) -> weight sync
-> engine; the Qwen3-VL-MoE example replays every token's routes (on-policy: no flips, the rollout's
log-probs); a supervised warm-up on VisualCount's demonstrations (with their images) runs before RL."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_agent import records as R
from relax_agent.train.algorithms import MISMATCH_ABS_DIFF_MAX

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {"visual_count": "tiny-vl", "audio_tones": "tiny-omni", "video_motion": "tiny-vl",
            "visual_count_qwen3": "tiny-vl3-moe"}


@pytest.fixture(scope="module")
def media_models(tmp_path_factory):
    from relax_agent.models import make_tiny_media_model

    return {k: make_tiny_media_model(tmp_path_factory.mktemp(k), kind=k) for k in set(EXAMPLES.values())}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_media_example_trains_two_steps(name, media_models, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", f"examples/{name}.yaml",
           f"model.path={media_models[EXAMPLES[name]]}", f"run.output_dir={out}"]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(s.get("step", 0) for s in steps) == 2
    rows = [json.loads(line) for f in sorted((out / "rollouts").glob("step_*.jsonl")) for line in f.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 4 and all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]][:2]


def test_media_travel_from_rollout_through_the_bus_to_the_trainer_and_back(media_models, tmp_path):
    from relax_agent.config import load_config
    from relax_agent.data import DataConfig, build_transfer_queue
    from relax_agent.roles import build_roles
    from relax_agent.rollout.engines.base import SamplingParams
    from relax_agent.runtime.base import PARTITION, GroupJob, TrainRef
    from relax_agent.runtime.local import build_local_runtime

    cfg = load_config(REPO / "examples/visual_count.yaml", [f"model.path={media_models['tiny-vl']}",
                                                            f"run.output_dir={tmp_path}", "trainer.lr=0.05"])
    roles = build_roles(cfg)
    bus = build_transfer_queue(DataConfig(backend="local"))
    runtime = build_local_runtime(cfg, roles, bus)
    try:
        bus.create_partition(PARTITION, capacity_rows=4, schema=R.rollout_schema())
        params = SamplingParams(max_new_tokens=8)
        job = GroupJob(0, "g0", roles.train_tasks[0], 0, 4)
        asyncio.run(runtime.rollout.play_group(job, params))
        bus.put(PARTITION, [f"g0/{i}" for i in range(4)], {R.ADVANTAGE: np.asarray([1, -1, 1, -1], np.float32)})
        batch = bus.get(PARTITION, [*R.TRAIN_FIELDS, R.TRAINABLE], consumer="trainer", batch_size=4, timeout_s=60)
        assert all(m is not None and m.kinds[0] == "image" for m in batch.fields[R.MEDIA])
        visual = {k: v.clone() for k, v in roles.trainer.policy_state_dict().items() if "visual" in k}
        metrics = runtime.trainer.train(TrainRef(PARTITION, tuple(batch.sample_ids), tuple(R.TRAIN_FIELDS), 1))
        assert metrics["train/grad_norm"] > 0
        after = roles.trainer.policy_state_dict()
        assert any(not torch.equal(visual[k], after[k]) for k in visual), "the vision encoder did not train"
        engine_state = roles.engine._model.state_dict()
        assert roles.engine.policy_version == 1
        assert all(torch.equal(engine_state[k], after[k]) for k in visual)  # the engine sees the new encoder
    finally:
        runtime.close()


def test_routes_travel_with_the_media_and_replay_the_rollout(media_models, tmp_path):
    """visual_count_qwen3 (Qwen3-VL-MoE, routing replay on): the roles' media engine records every
    token's experts, they reach the trainer through the bus beside the media, and the replayed forward
    reproduces the rollout's log-probs (fp32, on-policy) with no route flip."""
    from relax_agent.config import load_config
    from relax_agent.data import DataConfig, build_transfer_queue
    from relax_agent.roles import build_roles
    from relax_agent.rollout.engines.base import SamplingParams
    from relax_agent.runtime.base import PARTITION, GroupJob, TrainRef
    from relax_agent.runtime.local import build_local_runtime

    cfg = load_config(REPO / "examples/visual_count_qwen3.yaml", [f"model.path={media_models['tiny-vl3-moe']}",
                                                                  f"run.output_dir={tmp_path}"])
    roles = build_roles(cfg)
    bus = build_transfer_queue(DataConfig(backend="local"))
    runtime = build_local_runtime(cfg, roles, bus)
    try:
        layout = roles.engine.route_layout
        assert layout == ((2, 2), "uint8")
        bus.create_partition(PARTITION, capacity_rows=4, schema=R.rollout_schema(*layout))
        job = GroupJob(0, "g0", roles.train_tasks[0], 0, 4)
        asyncio.run(runtime.rollout.play_group(job, SamplingParams(max_new_tokens=8)))
        bus.put(PARTITION, [f"g0/{i}" for i in range(4)], {R.ADVANTAGE: np.asarray([1, -1, 1, -1], np.float32)})
        batch = bus.get(PARTITION, [*R.TRAIN_FIELDS, R.TRAINABLE, *R.ROUTE_FIELDS], consumer="trainer", batch_size=4,
                        timeout_s=60)
        ends = [int(np.flatnonzero(m)[-1]) + 1 for m in batch.fields[R.LOSS_MASK]]  # past each row's last policy token
        for end, mask, media in zip(ends, batch.fields[R.ROUTES_MASK], batch.fields[R.MEDIA], strict=True):
            assert media is not None and mask[:end].tolist() == [False] + [True] * (end - 1)  # image tokens too
        metrics = runtime.trainer.train(TrainRef(PARTITION, tuple(batch.sample_ids),
                                                 (*R.TRAIN_FIELDS, *R.ROUTE_FIELDS), 1))
        assert metrics["moe/route_flip_frac"] == 0.0 and metrics[MISMATCH_ABS_DIFF_MAX] < 1e-5, metrics
        assert metrics["moe/replayed_tokens"] == sum(int(m.sum()) for m in batch.fields[R.ROUTES_MASK])
    finally:
        runtime.close()


def test_visual_count_warms_up_on_demonstrations_with_their_images_through_the_cli(media_models, tmp_path):
    import gymnasium

    import relax_agent.envs  # noqa: F401
    from relax_agent.config import ModelConfig
    from relax_agent.models import load_tokenizer

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/visual_count.yaml",
           f"model.path={media_models['tiny-vl']}", f"run.output_dir={out}", "trainer.steps=1",
           "trainer.sft_warmup_steps=2", "trainer.sft_batch_size=8", "trainer.sft_lr=3e-3", "logging.tensorboard=false"]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tok = load_tokenizer(ModelConfig(path=str(media_models["tiny-vl"])))
    reply = len(tok("Answer: 1", add_special_tokens=False)["input_ids"]) + 1  # "Answer: N" then <|im_end|>
    sft = [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]
    assert [r["sft/step"] for r in sft] == [1, 2]
    assert [r["sft/tokens"] for r in sft] == [8 * reply, 8 * reply]
    assert sft[1]["sft/loss"] < sft[0]["sft/loss"] and sft[0]["sft/grad_norm"] > 0, sft
    summary = json.loads((out / "summary.json").read_text())
    train_tasks = gymnasium.make("relax/VisualCount-v0", difficulty=1).unwrapped.tasks("train")
    assert summary["sft"]["sft/demonstrations"] == len(train_tasks)  # every train task has one
    assert summary["sft"]["policy_version"] == 1 and summary["sft"]["sft/loss_last"] == sft[1]["sft/loss"]
    rows = [json.loads(line) for line in (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 and all(r["error"] is None for r in rows)
    assert {r["sample_version"] for r in rows} == {1}  # the first RL rollout ran on the warm-up's weights
    assert "eval_end" in summary
