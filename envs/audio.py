"""``relax/AudioTones-v0``: questions on a synthesised audio clip (beeps or a DTMF key).

    env = gymnasium.make("relax/AudioTones-v0", difficulty=1)
    messages, info = env.reset(seed=0)   # user: [text "How many beeps ...", input_audio (base64 WAV, 16 kHz)]
    env.step({"role": "assistant", "content": "Answer: 3"})      # reward 1.0 if right

Clips are 2 s at 16 kHz, rebuilt from each task's seed. ``difficulty`` (see :data:`LEVELS`):
1 counts 1-4 beeps of one pitch (chance 1/4); 2 adds noise and a random pitch per clip; 3 asks
which telephone key (DTMF digit 0-9) was pressed.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_agent.envs.media_env import MediaToolEnv, require, task_id
from relax_agent.envs.python_exec import parse_answer
from relax_agent.multimodal.parts import AUDIO_RATE_HZ, audio_part

ENV_ID = "relax/AudioTones-v0"
CLIP_S = 2.0
DTMF_HZ = {"1": (697, 1209), "2": (697, 1336), "3": (697, 1477), "4": (770, 1209), "5": (770, 1336),
           "6": (770, 1477), "7": (852, 1209), "8": (852, 1336), "9": (852, 1477), "0": (941, 1336)}


@dataclass(frozen=True)
class Level:
    """``task`` "beeps" (count 1..``max_beeps``) or "dtmf"; ``noise`` amplitude; random pitch or 660 Hz."""

    task: str
    max_beeps: int = 4
    noise: float = 0.0
    random_pitch: bool = False


LEVELS: dict[int, Level] = {1: Level("beeps"), 2: Level("beeps", 5, 0.05, True), 3: Level("dtmf")}


def synthesise(task: dict[str, Any], level: Level) -> np.ndarray:
    """[CLIP_S * 16000] float32 samples of ``task`` (deterministic in its ``clip_seed``)."""
    rng = np.random.default_rng(int(task["clip_seed"]))
    t = np.arange(int(CLIP_S * AUDIO_RATE_HZ)) / AUDIO_RATE_HZ
    out = np.zeros_like(t)
    if level.task == "dtmf":
        lo, hi = DTMF_HZ[str(task["answer"])]
        on = (t > 0.3) & (t < 1.5)
        out[on] = 0.4 * (np.sin(2 * np.pi * lo * t[on]) + np.sin(2 * np.pi * hi * t[on]))
    else:
        pitch = float(rng.uniform(400, 1000)) if level.random_pitch else 660.0
        n, slot = int(task["answer"]), CLIP_S / max(level.max_beeps, 1)
        for k in range(n):
            on = (t >= k * slot + 0.05) & (t < k * slot + 0.05 + 0.6 * slot)
            out[on] = 0.6 * np.sin(2 * np.pi * pitch * t[on])
    if level.noise:
        out += level.noise * rng.standard_normal(len(t))
    return out.astype(np.float32)


@functools.lru_cache(maxsize=16)
def make_tasks(difficulty: int, num_tasks: int, seed: int) -> tuple[dict[str, Any], ...]:
    """``num_tasks`` tasks ``{"id", "clip_seed", "question", "answer", "difficulty"}``."""
    level, rng = LEVELS[difficulty], random.Random(f"audio-tones-{difficulty}-{seed}")
    tasks = []
    for _ in range(num_tasks):
        clip_seed = rng.randrange(2**31)
        if level.task == "dtmf":
            answer, question = int(rng.choice(list(DTMF_HZ))), "Which telephone key (0-9) was pressed in this clip?"
        else:
            answer, question = rng.randint(1, level.max_beeps), "How many beeps are in this clip?"
        tasks.append({"id": task_id(f"audio-{difficulty}", clip_seed, answer), "clip_seed": clip_seed,
                      "question": question, "answer": answer, "difficulty": difficulty})
    return tuple(tasks)


class AudioTonesEnv(MediaToolEnv):
    """One question on a synthesised clip; single turn, reward 1 for the right integer.

    Args:
        difficulty: 1..3, see :data:`LEVELS`.
        num_tasks / seed / split / heldout_fraction: see :class:`~relax_agent.envs.media_env.MediaToolEnv`.
    """

    LEVELS = LEVELS
    reward_description = "1.0 when the final message states the right integer ('Answer: N', else the last integer); else 0.0."

    def __init__(self, difficulty: int = 1, num_tasks: int = 500, seed: int = 0, split: str = "train",
                 heldout_fraction: float = 0.2) -> None:
        super().__init__((), difficulty, num_tasks, seed, split, heldout_fraction)

    def make_tasks(self) -> list[dict[str, Any]]:
        """The ``num_tasks`` clips of this env's difficulty and seed (one task dict each)."""
        return list(make_tasks(self.difficulty, self.num_tasks, self.seed))

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The user message: the question and the synthesised clip as an audio part.

        Raises:
            DataError: the task lacks ``clip_seed``, ``question`` or ``answer``.
        """
        require(task, ("clip_seed", "question", "answer"), "AudioTones")
        clip = synthesise(task, LEVELS[self.task_difficulty(task)])
        return [{"role": "user", "content": [{"type": "text", "text": f"{task['question']} End with 'Answer: <n>'."},
                                             audio_part(clip)]}]

    def score(self, message: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """Reward 1.0 when the reply's integer (:func:`parse_answer`) equals the task's answer; info ``correct``
        and ``answered``."""
        got = parse_answer(message.get("content") or "")
        correct = got is not None and got == int(self.task["answer"])
        return float(correct), {"correct": float(correct), "answered": float(got is not None)}


def register() -> None:
    """Register ``relax/AudioTones-v0`` (one step per episode)."""
    from relax_agent.envs import register as register_env

    register_env(id=ENV_ID, entry_point="relax_agent.envs.audio:AudioTonesEnv", max_episode_steps=2)
