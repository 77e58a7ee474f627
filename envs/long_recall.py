"""``relax/LongRecall-v0``: a multi-turn task longer than a small context, where memory decides the reward.

The policy is shown a document one page per turn (the opening message is the instruction alone); the first
page states a code word, the others are filler. Whatever the policy replies, the next page follows; after the last page it is asked for the code word, and
its answer is scored: 1.0 when the reply holds it (case-insensitive, as a whole word), else 0.0. A scripted
policy (reply ``next`` to the instruction and each page, then the word it read on page 1) scores 1.0; an
episode takes ``pages + 2`` steps.

Episodes grow by about ``words_per_page`` x 1.3 tokens per page, so with a context smaller than the
document (``rollout.max_total_tokens``) the episode either ends before the question (``rollout.context:
truncate``), forgets page 1 (``drop_oldest``, unless page 1 still fits), or keeps the word only if its own
summary did (``compact``): the task that tells context policies apart (docs/guides/long-horizon.md).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from relax_agent.envs.base import TextEnv
from relax_agent.errors import ConfigError, DataError

ENV_ID = "relax/LongRecall-v0"
CODE_WORDS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
              "kelp", "lagoon", "meadow", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra",
              "umber", "violet", "walnut", "yarrow", "zephyr")
FILLER = ("the", "committee", "reviewed", "quarterly", "figures", "before", "noting", "that", "shipments", "rose",
          "while", "storage", "costs", "fell", "slightly", "across", "northern", "depots", "and", "staff", "asked",
          "for", "clearer", "schedules", "during", "winter", "months", "when", "roads", "close", "often")
HELDOUT_EVERY = 5
"""One task in this many (by id hash) is held out."""


class LongRecallEnv(TextEnv):
    """Read ``pages`` pages, then name the code word of page 1.

    Args:
        num_tasks: tasks generated from a fixed seed (one in :data:`HELDOUT_EVERY` held out, by id hash).
        pages: pages per document (the question comes after the last one); at least 1.
        words_per_page: filler words per page; at least 1.

    Raises:
        ConfigError: a non-positive ``num_tasks``, ``pages`` or ``words_per_page``.
    """

    reward_description = "1.0 when the final answer holds page 1's code word (whole word, any case), else 0.0"

    def __init__(self, num_tasks: int = 500, pages: int = 6, words_per_page: int = 60):
        super().__init__()
        for name, value in (("num_tasks", num_tasks), ("pages", pages), ("words_per_page", words_per_page)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{ENV_ID}: {name} must be a positive integer, got {value!r}")
        self.pages, self.words_per_page = pages, words_per_page
        rng = random.Random(20261207)
        self._tasks: list[dict[str, Any]] = []
        for i in range(num_tasks):
            word = rng.choice(CODE_WORDS)
            seed = rng.randrange(2**31)
            tid = "recall-" + hashlib.sha1(f"{i}:{word}:{seed}".encode()).hexdigest()[:10]
            self._tasks.append({"id": tid, "code_word": word, "seed": seed})
        self.page = 0

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Train or held-out tasks (disjoint, by id hash). Raises DataError for another split."""
        if split not in ("train", "heldout"):
            raise DataError(f"{ENV_ID}: split must be 'train' or 'heldout', got {split!r}")
        held = [t for t in self._tasks if int(t["id"][-4:], 16) % HELDOUT_EVERY == 0]
        return held if split == "heldout" else [t for t in self._tasks if int(t["id"][-4:], 16) % HELDOUT_EVERY]

    def _page(self, k: int) -> str:
        """Page ``k`` (1-based) of the current task's document."""
        assert self.task is not None
        rng = random.Random(self.task["seed"] * 1000 + k)
        filler = " ".join(rng.choice(FILLER) for _ in range(self.words_per_page))
        if k == 1:
            return f"Page 1 of {self.pages}. The code word is {self.task['code_word'].upper()}. {filler}."
        return f"Page {k} of {self.pages}. {filler}."

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The instruction alone (page 1 comes with the first step, so a context that keeps only the opening
        messages does not keep the word). Raises DataError for a task without ``code_word`` and ``seed``."""
        if "code_word" not in task or "seed" not in task:
            raise DataError(f"{ENV_ID} task needs 'code_word' and 'seed', got keys {sorted(task)}")
        self.page = 0
        intro = (f"You will read a document of {self.pages} pages, one page per turn. Reply 'next' to get each "
                 "page. At the end you will be asked for the code word on page 1.")
        return [{"role": "user", "content": intro}], {"tools": []}

    def step(self, action: dict[str, Any]):
        """The next page, the question after the last, or the score of the answer to it."""
        if self.task is None:
            raise DataError(f"{ENV_ID}: step before reset")
        if self.page < self.pages:
            self.page += 1
            return [{"role": "user", "content": self._page(self.page)}], 0.0, False, False, {"page": float(self.page)}
        if self.page == self.pages:
            self.page += 1
            question = "That was the last page. What is the code word on page 1? Answer with the word only."
            return [{"role": "user", "content": question}], 0.0, False, False, {"page": float(self.page)}
        words = {w.strip(".,:;!?'\"()").lower() for w in (action.get("content") or "").split()}
        correct = self.task["code_word"] in words
        return [], float(correct), True, False, {"correct": float(correct), "well_formed": float(bool(words))}


def register() -> None:
    """Register ``relax/LongRecall-v0``."""
    from relax_agent.envs import register as register_env

    register_env(id=ENV_ID, entry_point="relax_agent.envs.long_recall:LongRecallEnv")
