"""``relax/VideoMotion-v0``: which way did the shape move, over a few video frames.

    env = gymnasium.make("relax/VideoMotion-v0", difficulty=1)
    messages, info = env.reset(seed=0)   # user: [text "Which way ...", video (4 PNG frames)]
    env.step({"role": "assistant", "content": "Answer: left"})   # reward 1.0 if right

Frames are drawn with Pillow from each task's seed. ``difficulty``: 1 one square moving left or
right over 4 frames; 2 any of left/right/up/down; 3 the same with a static distractor shape.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from relax_agent.envs.media_env import MediaToolEnv, last_word, require, task_id
from relax_agent.multimodal.parts import video_part

ENV_ID = "relax/VideoMotion-v0"
STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass(frozen=True)
class Level:
    """``directions`` asked, ``frames`` per clip, ``size`` px frames, a static ``distractor`` or not."""

    directions: tuple[str, ...]
    frames: int = 4
    size: int = 56
    distractor: bool = False


LEVELS: dict[int, Level] = {1: Level(("left", "right")), 2: Level(tuple(STEP)), 3: Level(tuple(STEP), distractor=True)}


def frames_of(task: dict[str, Any], level: Level) -> list[Any]:
    """The clip's frames (PIL images), deterministic in ``task["clip_seed"]``."""
    from PIL import Image, ImageDraw

    rng = random.Random(int(task["clip_seed"]))
    dx, dy = STEP[task["answer"]]
    r, speed = level.size // 8, level.size // (2 * level.frames)
    span = speed * (level.frames - 1)
    x0 = rng.randint(r + max(0, -dx) * span, level.size - r - 1 - max(0, dx) * span)
    y0 = rng.randint(r + max(0, -dy) * span, level.size - r - 1 - max(0, dy) * span)
    other = (rng.randint(r, level.size - r - 1), rng.randint(r, level.size - r - 1))
    out = []
    for k in range(level.frames):
        img = Image.new("RGB", (level.size, level.size), (255, 255, 255))
        pen = ImageDraw.Draw(img)
        if level.distractor:
            pen.ellipse((other[0] - r, other[1] - r, other[0] + r, other[1] + r), fill=(40, 170, 60))
        x, y = x0 + dx * speed * k, y0 + dy * speed * k
        pen.rectangle((x - r, y - r, x + r, y + r), fill=(220, 40, 40))
        out.append(img)
    return out


@functools.lru_cache(maxsize=16)
def make_tasks(difficulty: int, num_tasks: int, seed: int) -> tuple[dict[str, Any], ...]:
    """``num_tasks`` tasks ``{"id", "clip_seed", "question", "answer", "difficulty"}``."""
    level, rng = LEVELS[difficulty], random.Random(f"video-motion-{difficulty}-{seed}")
    question = f"Which way did the red square move? Answer with one word: {', '.join(level.directions)}."
    tasks = []
    for _ in range(num_tasks):
        clip_seed, answer = rng.randrange(2**31), rng.choice(level.directions)
        tasks.append({"id": task_id(f"video-{difficulty}", clip_seed, answer), "clip_seed": clip_seed,
                      "question": question, "answer": answer, "difficulty": difficulty})
    return tuple(tasks)


class VideoMotionEnv(MediaToolEnv):
    """One question on a short clip; single turn, reward 1 for the right direction word.

    Args:
        difficulty: 1..3, see :data:`LEVELS`.
        num_tasks / seed / split / heldout_fraction: see :class:`~relax_agent.envs.media_env.MediaToolEnv`.
    """

    LEVELS = LEVELS
    reward_description = "1.0 when the final message's last direction word (left/right/up/down) is right; else 0.0."

    def __init__(self, difficulty: int = 1, num_tasks: int = 500, seed: int = 0, split: str = "train",
                 heldout_fraction: float = 0.2) -> None:
        super().__init__((), difficulty, num_tasks, seed, split, heldout_fraction)

    def make_tasks(self) -> list[dict[str, Any]]:
        """The ``num_tasks`` clips of this env's difficulty and seed (one task dict each)."""
        return list(make_tasks(self.difficulty, self.num_tasks, self.seed))

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The user message: the question and the clip's frames as a video part.

        Raises:
            DataError: the task lacks ``clip_seed``, ``question`` or ``answer``.
        """
        require(task, ("clip_seed", "question", "answer"), "VideoMotion")
        frames = frames_of(task, LEVELS[self.task_difficulty(task)])
        return [{"role": "user", "content": [{"type": "text", "text": task["question"]}, video_part(frames)]}]

    def score(self, message: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """Reward 1.0 when the last direction word equals the task's answer; info ``correct`` and ``answered``."""
        got = last_word(message.get("content") or "", list(STEP))
        correct = got == self.task["answer"]
        return float(correct), {"correct": float(correct), "answered": float(got is not None)}


def register() -> None:
    """Register ``relax/VideoMotion-v0`` (one step per episode)."""
    from relax_agent.envs import register as register_env

    register_env(id=ENV_ID, entry_point="relax_agent.envs.video:VideoMotionEnv", max_episode_steps=2)
