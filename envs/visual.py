"""``relax/VisualCount-v0``: questions on an image of coloured shapes, with a zoom tool.

    env = gymnasium.make("relax/VisualCount-v0", difficulty=1)
    messages, info = env.reset(seed=0)   # user: [text "How many shapes ...", image_url (PNG data URL)]
    obs, *_ = env.step({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "zoom", "arguments": {"quadrant": "top-left"}}}]})
    # obs: [{"role": "tool", "content": [{"type": "text", ...}, {"type": "image_url", ...}]}]
    env.step({"role": "assistant", "content": "Answer: 3"})      # reward 1.0 if right

Images are drawn with Pillow from each task's own seed, so a task dict is small and a reset is
deterministic. ``difficulty`` (see :data:`LEVELS`): 1 asks how many shapes (1-4, one shape type:
chance 1/4, the answer one token); 2 how many of one shape among distractors (0-5); 3 also asks
for the colour of the only shape of a kind or which half holds more shapes.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from relax_agent.envs.media_env import MediaToolEnv, last_word, require, task_id
from relax_agent.envs.python_exec import parse_answer
from relax_agent.multimodal.parts import image_part

ENV_ID = "relax/VisualCount-v0"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUADRANTS = ("top-left", "top-right", "bottom-left", "bottom-right")


@dataclass(frozen=True)
class Level:
    """One difficulty: ``size`` px square images with ``min_count``..``max_count`` target shapes,
    up to ``distractors`` shapes of another kind, and the question kinds asked."""

    size: int
    min_count: int
    max_count: int
    distractors: int
    questions: tuple[str, ...]


LEVELS: dict[int, Level] = {
    1: Level(84, 1, 4, 0, ("count_all",)),
    2: Level(112, 0, 5, 3, ("count_shape",)),
    3: Level(112, 0, 5, 3, ("count_shape", "colour", "side")),
}


def _scene(seed: int, level: Level) -> tuple[list[tuple[str, str, int, int, int]], str, Any]:
    """(shapes [(shape, colour, x, y, radius)], question kind, its parameter) of a task seed."""
    rng = random.Random(seed)
    kind = rng.choice(level.questions)
    target = rng.choice(SHAPES)
    n = rng.randint(max(level.min_count, 1 if kind in ("count_all", "colour", "side") else 0), level.max_count)
    if kind == "colour":
        n = 1
    others = [s for s in SHAPES if s != target]
    shapes = [(target, rng.choice(list(COLOURS))) for _ in range(n)]
    shapes += [(rng.choice(others), rng.choice(list(COLOURS))) for _ in range(rng.randint(0, level.distractors))]
    r = level.size // 12
    cells = [(x, y) for x in range(r + 2, level.size - r - 2, 2 * r + 3) for y in range(r + 2, level.size - r - 2, 2 * r + 3)]
    spots = rng.sample(cells, len(shapes))
    return [(s, c, x, y, r) for (s, c), (x, y) in zip(shapes, spots, strict=True)], kind, target


def draw(shapes: list[tuple[str, str, int, int, int]], size: int) -> Any:
    """A white ``size`` x ``size`` PIL image with ``shapes`` drawn on it."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(img)
    for shape, colour, x, y, r in shapes:
        fill = COLOURS[colour]
        if shape == "circle":
            pen.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif shape == "square":
            pen.rectangle((x - r, y - r, x + r, y + r), fill=fill)
        else:
            pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return img


@functools.lru_cache(maxsize=16)
def make_tasks(difficulty: int, num_tasks: int, seed: int) -> tuple[dict[str, Any], ...]:
    """``num_tasks`` distinct tasks ``{"id", "scene_seed", "question", "answer", "answer_kind", "difficulty"}``."""
    level = LEVELS[difficulty]
    tasks: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    rng = random.Random(f"visual-count-{difficulty}-{seed}")
    for _ in range(num_tasks * 20):
        if len(tasks) == num_tasks:
            break
        scene_seed = rng.randrange(2**31)
        shapes, kind, target = _scene(scene_seed, level)
        key = (tuple(shapes), kind, target)
        if key in seen:
            continue
        seen.add(key)
        question, answer = _question(shapes, kind, target, level.size)
        tasks.append({"id": task_id(f"visual-{difficulty}", *key), "scene_seed": scene_seed, "question": question,
                      "answer": answer, "answer_kind": "word" if kind in ("colour", "side") else "int",
                      "difficulty": difficulty})
    return tuple(tasks)


def _question(shapes: list[tuple], kind: str, target: str, size: int) -> tuple[str, Any]:
    if kind == "count_all":
        return "How many shapes are in the image?", len(shapes)
    if kind == "count_shape":
        return f"How many {target}s are in the image?", sum(s[0] == target for s in shapes)
    if kind == "colour":
        colour = next(c for s, c, *_ in shapes if s == target)
        return f"What colour is the {target}? Answer with one of: {', '.join(COLOURS)}.", colour
    left = sum(x < size // 2 for _, _, x, _, _ in shapes)
    side = "left" if left > len(shapes) - left else "right" if left < len(shapes) - left else "equal"
    return "Which half of the image holds more shapes? Answer left, right or equal.", side


class VisualCountEnv(MediaToolEnv):
    """Questions on a procedural image; a ``zoom`` tool returns one quadrant enlarged 2x.

    Args:
        difficulty: 1..3, see :data:`LEVELS`.
        num_tasks / seed / split / heldout_fraction: see :class:`~relax_agent.envs.media_env.MediaToolEnv`.
        tools: offer the ``zoom`` tool (multi-turn with an image tool result).

    Raises:
        ConfigError: an argument outside those values.
    """

    LEVELS = LEVELS
    reward_description = ("1.0 when the final assistant message (one without tool calls) answers the question: "
                          "the integer ('Answer: N', else the last integer) or the word asked for; else 0.0.")

    def __init__(self, difficulty: int = 1, num_tasks: int = 500, seed: int = 0, split: str = "train",
                 heldout_fraction: float = 0.2, tools: bool = True) -> None:
        super().__init__((self.zoom,) if tools else (), difficulty, num_tasks, seed, split, heldout_fraction)
        self._image: Any = None

    def make_tasks(self) -> list[dict[str, Any]]:
        """The ``num_tasks`` scenes of this env's difficulty and seed (one task dict each)."""
        return list(make_tasks(self.difficulty, self.num_tasks, self.seed))

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The user message: the question (with the ``zoom`` hint when the tool is on) and the scene's image;
        keeps the image for ``zoom``.

        Raises:
            DataError: the task lacks ``scene_seed``, ``question`` or ``answer``.
        """
        require(task, ("scene_seed", "question", "answer"), "VisualCount")
        level = LEVELS[self.task_difficulty(task)]
        self._image = draw(_scene(int(task["scene_seed"]), level)[0], level.size)
        hint = " You may call zoom(quadrant) to see a quarter of the image enlarged." if self.tools else ""
        text = f"{task['question']}{hint} End with 'Answer: <answer>'."
        return [{"role": "user", "content": [{"type": "text", "text": text}, image_part(self._image)]}]

    def zoom(self, quadrant: str) -> list[dict[str, Any]]:
        """Show one quarter of the image, enlarged two times.

        Args:
            quadrant: One of "top-left", "top-right", "bottom-left", "bottom-right".
        """
        if quadrant not in QUADRANTS:
            raise ValueError(f"quadrant must be one of {list(QUADRANTS)}, got {quadrant!r}")
        w, h = self._image.size
        i = QUADRANTS.index(quadrant)
        box = ((i % 2) * w // 2, (i // 2) * h // 2, (i % 2 + 1) * w // 2, (i // 2 + 1) * h // 2)
        crop = self._image.crop(box).resize((w, h))
        return [{"type": "text", "text": f"The {quadrant} quarter:"}, image_part(crop)]

    def score(self, message: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """Reward 1.0 when the reply's answer (its integer, or its last colour / side word) equals the task's;
        info ``correct`` and ``answered``."""
        text = message.get("content") or ""
        if self.task["answer_kind"] == "int":
            got: Any = parse_answer(text)
            correct = got is not None and got == int(self.task["answer"])
        else:
            got = last_word(text, [*COLOURS, "left", "right", "equal"])
            correct = got == self.task["answer"]
        return float(correct), {"correct": float(correct), "answered": float(got is not None)}


def register() -> None:
    """Register ``relax/VisualCount-v0`` (at most 4 steps per episode, then truncated)."""
    from relax_agent.envs import register as register_env

    register_env(id=ENV_ID, entry_point="relax_agent.envs.visual:VisualCountEnv", max_episode_steps=4)
