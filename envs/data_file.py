"""``relax/DataFile-v0``: find a data file in a sandbox, compute over it with Python, answer.

A multi-turn agent task. At ``reset`` a file of integers (one per line) is written into the
sandbox's work directory under a name the question does not give. The policy has one tool,
``run_python`` (:data:`relax_agent.envs.python_exec.TOOL_SCHEMA`); the natural episode uses it
twice across turns, each call built on the previous observation:

1. list the work directory (the reply shows the file's name);
2. read that file and compute the statistic the question asks for (the reply shows the number);
3. answer ``Answer: <integer>``.

    env = gymnasium.make("relax/DataFile-v0", sandbox={"backend": "docker"})
    messages, info = env.reset(seed=0)   # "A data file in the working directory ... sum ..."

Reward 1.0 for the right integer in the final message (no tool calls), else 0.0; the info says
how many tool calls ran (``tool_calls``). The numbers live only in the sandbox: the question
cannot be answered without reading the file, and the file cannot be read without its name.
Tasks are procedural and the splits disjoint (one in ten, by SHA-1 of the file's content, is
held out). :meth:`DataFileEnv.demonstration` gives the three-turn reference episode, observations
included, for a supervised warm-up.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from typing import Any

from relax_agent.envs.python_exec import INSTRUCTION, TOOL_NAME, TOOL_SCHEMA, PythonExecEnv
from relax_agent.errors import DataError, SandboxError
from relax_agent.sandboxes import Sandbox, run_sync

ENV_ID = "relax/DataFile-v0"
SPLITS = ("train", "heldout")
_NUM_TASKS = 3000
_HELDOUT_MOD = 10
_STEMS = ("sales", "scores", "orders", "temps", "visits", "stock", "levels", "counts", "prices", "votes")
LIST_CODE = "import os\nprint(sorted(os.listdir('.')))"
"""The reference first call: list the work directory."""
_READ = "nums = [int(x) for x in open('{name}').read().split()]\n"
_KINDS: dict[str, tuple[str, str]] = {
    # kind: (the question, the reference code's last line)
    "sum": ("What is the sum of its numbers?", "print(sum(nums))"),
    "max": ("What is the largest of its numbers?", "print(max(nums))"),
    "min": ("What is the smallest of its numbers?", "print(min(nums))"),
    "count_gt": ("How many of its numbers are greater than {k}?", "print(sum(1 for x in nums if x > {k}))"),
    "sum_even": ("What is the sum of its even numbers?", "print(sum(x for x in nums if x % 2 == 0))"),
}


def _answer(kind: str, nums: list[int], k: int) -> int:
    if kind == "sum":
        return sum(nums)
    if kind == "max":
        return max(nums)
    if kind == "min":
        return min(nums)
    if kind == "count_gt":
        return sum(1 for x in nums if x > k)
    return sum(x for x in nums if x % 2 == 0)


def _make_task(rng: random.Random) -> dict[str, Any]:
    """One task: the file's name and content, the question, the answer (computed on the host)."""
    name = f"{rng.choice(_STEMS)}_{rng.randint(1000, 9999)}.txt"
    nums = [rng.randint(1, 999) for _ in range(rng.randint(12, 30))]
    kind = rng.choice(list(_KINDS))
    k = rng.choice([100, 250, 400, 500, 600, 750, 900])
    question = f"A data file in the working directory holds one integer per line. {_KINDS[kind][0].format(k=k)}"
    return {"kind": kind, "file": name, "content": "\n".join(map(str, nums)) + "\n", "k": k,
            "question": question, "answer": _answer(kind, nums, k)}


@functools.cache
def make_tasks(split: str) -> list[dict[str, Any]]:
    """The deterministic task list of ``split`` (cached; do not mutate); splits are disjoint by file content.

    Raises:
        DataError: unknown split.
    """
    if split not in SPLITS:
        raise DataError(f"split={split!r}; expected one of {list(SPLITS)}")
    rng, tasks = random.Random(20261202), []
    for _ in range(_NUM_TASKS):
        task = _make_task(rng)
        digest = hashlib.sha1(f"{task['file']}\n{task['content']}".encode()).hexdigest()
        if (int(digest, 16) % _HELDOUT_MOD == 0) == (split == "heldout"):
            tasks.append({"id": f"datafile-{digest[:12]}", **task})
    return tasks


def _call(i: int, code: str) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": code}}}


class DataFileEnv(PythonExecEnv):
    """Find-then-compute tasks over a file in the sandbox (see the module docstring).

    Takes :class:`~relax_agent.envs.python_exec.PythonExecEnv`'s arguments (sandbox, pool, split,
    max_tool_calls, exec_timeout_s, max_observation_chars) and its ``step``. The sandbox is taken
    at the episode's first tool call (a reset or an answer alone needs none) and reset between
    episodes, so no file outlives its task.

    Raises:
        ConfigError: an argument outside the values PythonExecEnv accepts.
    """

    reward_description = (
        "1.0 when the final assistant message (one without tool calls) states the integer the question "
        "asks for ('Answer: N', else \\boxed{N}, else the last integer); else 0.0. The numbers are only "
        "in the sandbox's file, whose name the question does not give."
    )

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Task dicts ``{"id", "kind", "file", "content", "k", "question", "answer"}`` of ``split``."""
        return make_tasks(split)

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        missing = {"question", "answer", "file", "content"} - set(task)
        if missing:
            raise DataError(f"DataFile task lacks {sorted(missing)}; got keys {sorted(task)}")
        self._release()  # the sandbox is taken at the first tool call: a reset alone costs no container
        self._calls, self._done = 0, False
        messages = [{"role": "user", "content": f"{task['question']}\n{INSTRUCTION}"}]
        return messages, {"tools": [json.loads(json.dumps(TOOL_SCHEMA))], "task_id": task.get("id")}

    def _episode_open(self) -> bool:
        return self.task is not None and not self._done

    def _ready_sandbox(self) -> Sandbox:
        """The episode's sandbox, taken (and given the task's file) at the first tool call.

        Raises:
            SandboxError: the sandbox could not be started or the file not written.
        """
        if self.sandbox is None:
            self._acquire()
            assert self.sandbox is not None and self.task is not None
            try:
                run_sync(self.sandbox.write_file(self.task["file"], self.task["content"]), loop=self._loop())
            except SandboxError:
                self._release(discard=True)
                raise
        return self.sandbox

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The reference episode: list the directory, compute with the file's name, answer.

        Returns:
            The messages after the prompt, in order: assistant (tool call), tool (its output, as
            :meth:`step` returns it), assistant (tool call), tool, assistant (``Answer: N``).
            Tool outputs are what the sandbox prints for these calls in a fresh episode (a test
            steps a real sandbox through them).
        """
        listing = json.dumps([task["file"]]).replace('"', "'")
        compute = _READ.format(name=task["file"]) + _KINDS[task["kind"]][1].format(k=task["k"])
        calls = [_call(0, LIST_CODE), _call(1, compute)]
        out: list[dict[str, Any]] = []
        for call, result in zip(calls, (listing, str(task["answer"])), strict=True):
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            out.append({"role": "tool", "tool_call_id": call["id"], "name": TOOL_NAME, "content": result})
        out.append({"role": "assistant", "content": f"Answer: {task['answer']}"})
        return out


def register() -> None:
    """Register ``relax/DataFile-v0`` in gymnasium's registry."""
    from relax_agent.envs import register as register_env

    register_env(id=ENV_ID, entry_point="relax_agent.envs.data_file:DataFileEnv")


__all__ = ["DataFileEnv", "ENV_ID", "make_tasks"]
