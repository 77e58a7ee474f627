"""The built-in media envs pass the env contract suite (gymnasium's checker included), keep
their held-out split disjoint, and answer their own questions."""

from __future__ import annotations

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401 - registers the envs
from relax_agent.envs.testing import EnvContract
from relax_agent.multimodal.parts import decode_audio, decode_image, decode_video

IDS = ("relax/VisualCount-v0", "relax/AudioTones-v0", "relax/VideoMotion-v0")


class TestVisualCountContract(EnvContract):
    def make_env(self):
        return gymnasium.make("relax/VisualCount-v0", num_tasks=40)


class TestVisualCountHardContract(EnvContract):
    def make_env(self):
        return gymnasium.make("relax/VisualCount-v0", difficulty=3, num_tasks=40)


class TestAudioTonesContract(EnvContract):
    def make_env(self):
        return gymnasium.make("relax/AudioTones-v0", num_tasks=40)


class TestVideoMotionContract(EnvContract):
    def make_env(self):
        return gymnasium.make("relax/VideoMotion-v0", difficulty=3, num_tasks=40)


@pytest.mark.parametrize("env_id", IDS)
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_splits_are_disjoint_and_deterministic(env_id, difficulty):
    env = gymnasium.make(env_id, difficulty=difficulty, num_tasks=200).unwrapped
    train, heldout = env.tasks("train"), env.tasks("heldout")
    assert train and heldout and not {t["id"] for t in train} & {t["id"] for t in heldout}
    assert len({t["id"] for t in train + heldout}) == len(train) + len(heldout)
    assert gymnasium.make(env_id, difficulty=difficulty, num_tasks=200).unwrapped.tasks("heldout") == heldout
    assert gymnasium.make(env_id, difficulty=difficulty, num_tasks=200, seed=1).unwrapped.tasks("heldout") != heldout


def test_visual_count_right_answer_scores_and_zoom_returns_an_image():
    env = gymnasium.make("relax/VisualCount-v0")
    task = env.unwrapped.tasks("train")[0]
    obs, info = env.reset(seed=0, options={"task": task})
    image = decode_image(obs[0]["content"][1])
    assert image.size == (84, 84) and [t["function"]["name"] for t in info["tools"]] == ["zoom"]
    call = {"id": "c1", "type": "function", "function": {"name": "zoom", "arguments": {"quadrant": "bottom-right"}}}
    tool_obs, reward, done, *_ = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert not done and reward == 0.0 and tool_obs[0]["role"] == "tool"
    assert [p["type"] for p in tool_obs[0]["content"]] == ["text", "image_url"]
    assert decode_image(tool_obs[0]["content"][1]).size == (84, 84)
    _, reward, done, *_ = env.step({"role": "assistant", "content": f"Answer: {task['answer']}"})
    assert done and reward == 1.0
    env.reset(seed=0, options={"task": task})
    assert env.step({"role": "assistant", "content": f"Answer: {task['answer'] + 1}"})[1] == 0.0


def test_audio_tones_beeps_are_audible_and_scored():
    env = gymnasium.make("relax/AudioTones-v0")
    task = env.unwrapped.tasks("train")[0]
    obs, _ = env.reset(seed=0, options={"task": task})
    clip = decode_audio(obs[0]["content"][1])
    on = (abs(clip).reshape(-1, 160).max(axis=1) > 0.1).astype(int)  # 10 ms envelope
    assert len(clip) == 32000 and int(((on[1:] - on[:-1]) == 1).sum() + on[0]) == task["answer"]
    assert env.step({"role": "assistant", "content": f"Answer: {task['answer']}"})[1] == 1.0


def test_video_motion_frames_move_the_way_the_answer_says():
    env = gymnasium.make("relax/VideoMotion-v0", difficulty=2)
    for task in env.unwrapped.tasks("train")[:8]:
        obs, _ = env.reset(seed=0, options={"task": task})
        frames = decode_video(obs[0]["content"][1])
        import numpy as np

        centres = [np.argwhere((np.asarray(f)[..., 0] > 200) & (np.asarray(f)[..., 1] < 100)).mean(0) for f in frames]
        dy, dx = centres[-1] - centres[0]
        seen = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
        assert seen == task["answer"]
        assert env.step({"role": "assistant", "content": f"It moved {seen}."})[1] == 1.0
