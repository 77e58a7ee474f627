"""``relax/PythonExec-v0``: compute a number with a sandboxed Python tool, then answer.

    env = gymnasium.make("relax/PythonExec-v0", sandbox={"backend": "docker", "pool": {"size": 8}})
    messages, info = env.reset(seed=0)               # info["tools"]: the run_python schema
    obs, reward, terminated, truncated, info = env.step(
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "run_python", "arguments": '{"code": "print(2**10)"}'}}]})
    # obs: [{"role": "tool", "tool_call_id": "c1", "name": "run_python", "content": "1024\\n"}]
    env.step({"role": "assistant", "content": "Answer: 1024"})   # reward 1.0 if right; episode ends
    env.close()                                                  # gives the sandbox back

The sandbox is acquired at ``reset`` and released at ``close`` (or at the next ``reset``): from
a process-wide warm pool when ``sandbox.pool.size > 0``, from a :class:`SandboxPool` passed as
``pool=``, else created for the episode. Tasks are procedural (sums of squares, Fibonacci
residues, prime counts, digit sums...): cheap to generate, exact to check, and tedious enough
by hand that running code helps. A sandbox failure (not the model's code failing) raises
:class:`~relax_agent.errors.SandboxError`, so the episode is recorded as an infrastructure
failure instead of a wrong answer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import re
from typing import Any

from relax_agent.envs.base import TextEnv
from relax_agent.errors import ConfigError, DataError, EnvError, SandboxError
from relax_agent.sandboxes import ExecResult, Sandbox, SandboxConfig, SandboxPool, run_sync, shared_pool
from relax_agent.sandboxes.limits import unencodable

ENV_ID = "relax/PythonExec-v0"
TOOL_NAME = "run_python"
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python 3 code in a sandbox (no network, a few seconds, small memory) and "
                       "return what it prints to stdout and stderr. Print the values you need.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python 3 source code to run."}},
            "required": ["code"],
        },
    },
}
INSTRUCTION = "Use the run_python tool to compute it, then reply with a final line 'Answer: <integer>'."
SPLITS = ("train", "heldout")
_NUM_TASKS = 2400
_HELDOUT_MOD = 10  # one task in ten (by SHA-1 of its question) is held out


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\0\0"
    for i in range(2, math.isqrt(n - 1) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(range(i * i, n, i)))
    return sum(sieve)


def _fib_mod(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a


def _sum_multiples(a: int, n: int) -> int:
    k = n // a
    return a * k * (k + 1) // 2


def _make_task(rng: random.Random) -> tuple[str, str, int]:
    """One ``(kind, question, answer)``; answers are computed here, on the host, by trusted code."""
    kind = rng.choice(["squares", "fib", "primes", "digits_pow", "digits_fact", "multiples", "collatz"])
    if kind == "squares":
        n = rng.randint(20, 900)
        return kind, f"What is the sum of the squares of the integers from 1 to {n}?", n * (n + 1) * (2 * n + 1) // 6
    if kind == "fib":
        n, m = rng.randint(50, 5000), rng.choice([97, 1000, 10007, 65537, 1000003])
        return kind, f"With F(0)=0 and F(1)=1, what is the Fibonacci number F({n}) modulo {m}?", _fib_mod(n, m)
    if kind == "primes":
        n = rng.randint(100, 50000)
        return kind, f"How many prime numbers are smaller than {n}?", _primes_below(n)
    if kind == "digits_pow":
        k = rng.randint(40, 600)
        return kind, f"What is the sum of the decimal digits of 2 to the power {k}?", sum(map(int, str(2**k)))
    if kind == "digits_fact":
        n = rng.randint(15, 150)
        return kind, f"What is the sum of the decimal digits of {n} factorial?", sum(map(int, str(math.factorial(n))))
    if kind == "multiples":
        a, b = rng.sample([3, 4, 5, 6, 7, 11, 13], 2)
        n = rng.randint(100, 100000)
        total = _sum_multiples(a, n) + _sum_multiples(b, n) - _sum_multiples(math.lcm(a, b), n)
        return kind, f"What is the sum of all positive integers up to and including {n} that are divisible by {a} or {b}?", total
    n = rng.randint(27, 100000)
    steps, x = 0, n
    while x != 1:
        x, steps = (x // 2 if x % 2 == 0 else 3 * x + 1), steps + 1
    return kind, f"Starting from {n}, how many steps of the Collatz map (n/2 if even, 3n+1 if odd) reach 1?", steps


@functools.cache
def make_tasks(split: str) -> list[dict[str, Any]]:
    """The deterministic task list of ``split`` (cached; do not mutate); splits are disjoint by question text.

    Raises:
        DataError: unknown split.
    """
    if split not in SPLITS:
        raise DataError(f"split={split!r}; expected one of {list(SPLITS)}")
    rng, seen, tasks = random.Random(20240601), set(), []
    for _ in range(_NUM_TASKS):
        kind, question, answer = _make_task(rng)
        if question in seen:
            continue
        seen.add(question)
        digest = hashlib.sha1(question.encode()).hexdigest()
        held = int(digest, 16) % _HELDOUT_MOD == 0
        if held == (split == "heldout"):
            tasks.append({"id": f"pyexec-{digest[:12]}", "kind": kind, "question": question, "answer": answer})
    return tasks


def parse_answer(text: str) -> int | None:
    """The integer after the last ``Answer:`` (or in the last ``\\boxed{}``), else the last integer.

    Thousands separators (``1,024``) are accepted. None when the text holds no integer.
    """
    for pattern in (r"answer\s*[:=]\s*\**\s*(-?[\d,]*\d)", r"\\boxed\{\s*(-?[\d,]*\d)\s*\}", r"(-?\d[\d,]*\d|-?\d)"):
        found = re.findall(pattern, text, flags=re.I)
        if found:
            return int(found[-1].replace(",", ""))
    return None


def format_result(res: ExecResult, timeout_s: float, max_chars: int) -> str:
    """A tool observation for the model: stdout, then stderr and what went wrong, capped at ``max_chars``."""
    parts = [res.stdout]
    if res.stderr:
        parts.append(f"[stderr]\n{res.stderr}")
    if res.timed_out:
        parts.append(f"[killed: timed out after {timeout_s:g} s]")
    elif res.oom_killed:
        parts.append("[killed: out of memory]")
    elif res.exit_code != 0:
        parts.append(f"[exit code {res.exit_code}]")
    if res.truncated:
        parts.append("[output truncated]")
    text = "\n".join(p.rstrip("\n") for p in parts if p) or "[no output]"
    return text if len(text) <= max_chars else text[:max_chars] + "\n[observation truncated]"


class PythonExecEnv(TextEnv):
    """Compute-then-answer tasks with a sandboxed ``run_python`` tool.

    Args:
        sandbox: a :class:`SandboxConfig` or its dict (default: Docker with its default limits).
        pool: a started :class:`SandboxPool` to take sandboxes from (overrides ``sandbox``).
        split: the split ``reset`` draws from when no task is given ("train" or "heldout").
        max_tool_calls: tool calls executed per episode; later calls get a refusal message.
        exec_timeout_s: timeout of one ``run_python`` call.
        max_observation_chars: longest tool observation returned to the model.

    Raises:
        ConfigError: an argument outside the values above, or an invalid sandbox config.
    """

    reward_description = (
        "1.0 when the final assistant message (one without tool calls) states the task's integer "
        "answer ('Answer: N', else \\boxed{N}, else the last integer in the message); else 0.0. "
        "Tool calls earn nothing by themselves."
    )

    def __init__(self, sandbox: SandboxConfig | dict[str, Any] | None = None, pool: SandboxPool | None = None,
                 split: str = "train", max_tool_calls: int = 4, exec_timeout_s: float = 5.0,
                 max_observation_chars: int = 2000) -> None:
        super().__init__()
        try:
            self.sandbox_config = sandbox if isinstance(sandbox, SandboxConfig) else SandboxConfig(**(sandbox or {}))
        except ValueError as exc:
            raise ConfigError(f"env.kwargs.sandbox is invalid: {exc}") from None
        if split not in SPLITS:
            raise ConfigError(f"split={split!r}; expected one of {list(SPLITS)}")
        if max_tool_calls < 1 or exec_timeout_s <= 0 or max_observation_chars < 100:
            raise ConfigError(f"need max_tool_calls >= 1, exec_timeout_s > 0, max_observation_chars >= 100; got "
                              f"{max_tool_calls}, {exec_timeout_s}, {max_observation_chars}")
        self.pool = pool
        self.split = split
        self.max_tool_calls = max_tool_calls
        self.exec_timeout_s = exec_timeout_s
        self.max_observation_chars = max_observation_chars
        self.sandbox: Sandbox | None = None
        self._from: SandboxPool | None = None
        self._calls = 0
        self._done = False

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Task dicts ``{"id", "kind", "question", "answer"}`` of ``split`` (see :func:`make_tasks`)."""
        return make_tasks(split)

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if "question" not in task or "answer" not in task:
            raise DataError(f"PythonExec task needs 'question' and 'answer', got keys {sorted(task)}")
        self._release()
        self._acquire()
        self._calls, self._done = 0, False
        messages = [{"role": "user", "content": f"{task['question']}\n{INSTRUCTION}"}]
        return messages, {"tools": [json.loads(json.dumps(TOOL_SCHEMA))], "task_id": task.get("id")}

    # -- sandbox lifetime ----------------------------------------------------------------------
    def _loop(self):
        return self._from.loop if self._from is not None else None

    def _acquire(self) -> None:
        self._from = self.pool or (shared_pool(self.sandbox_config) if self.sandbox_config.pool.size > 0 else None)
        if self._from is not None:
            self.sandbox = run_sync(self._from.acquire(), loop=self._from.loop)
        else:
            self.sandbox = run_sync(self.sandbox_config.build().create())

    def _release(self, discard: bool = False) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is None:
            return
        if self._from is not None:
            run_sync(self._from.release(sb, discard=discard), loop=self._from.loop)
        else:
            run_sync(sb.close())

    def _ready_sandbox(self) -> Sandbox:
        """The episode's sandbox, ready for a tool call."""
        assert self.sandbox is not None
        return self.sandbox

    def close(self) -> None:
        """Give the sandbox back (idempotent)."""
        self._release()
        super().close()

    # -- stepping ------------------------------------------------------------------------------
    def _run_tool(self, call: dict[str, Any]) -> dict[str, Any]:
        raw_function = call.get("function")
        function = raw_function if isinstance(raw_function, dict) else {}
        name, args = function.get("name"), function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        reply = {"role": "tool", "tool_call_id": call.get("id", ""), "name": name or ""}
        if name != TOOL_NAME:
            return {**reply, "content": f"error: unknown tool {name!r}; the only tool is {TOOL_NAME}"}
        if not isinstance(args, dict) or not isinstance(args.get("code"), str):
            return {**reply, "content": 'error: arguments must be a JSON object {"code": "<python source>"}'}
        why = unencodable(args["code"])
        if why is not None:  # the model's fault, not the sandbox's: an error it can read, the sandbox kept
            return {**reply, "content": f"error: code holds {why}; send UTF-8 Python source"}
        self._calls += 1
        if self._calls > self.max_tool_calls:
            return {**reply, "content": f"error: tool call limit ({self.max_tool_calls}) reached; give your answer now"}
        sandbox = self._ready_sandbox()
        try:
            res = run_sync(sandbox.run_python(args["code"], timeout_s=self.exec_timeout_s), loop=self._loop())
        except SandboxError:
            self._release(discard=True)
            raise
        return {**reply, "content": format_result(res, self.exec_timeout_s, self.max_observation_chars)}

    def _episode_open(self) -> bool:
        """An episode was reset and has not ended (its sandbox is held)."""
        return self.task is not None and not self._done and self.sandbox is not None

    def step(self, action: dict[str, Any]):
        """Run the message's tool calls, or judge its final answer.

        Returns:
            With tool calls: ``(tool messages, 0.0, False, False, info)``. Without: ``([], reward,
            True, False, info)``, info ``{"correct", "answered", "tool_calls"}``.

        Raises:
            EnvError: ``step`` before ``reset``, after the episode ended, or a non-dict action.
            SandboxError: the sandbox failed (an infrastructure failure, not a wrong answer).
        """
        if not self._episode_open():
            raise EnvError(f"{type(self).__name__}.step() needs a fresh episode: call reset() first")
        if not isinstance(action, dict):
            raise EnvError(f"action must be an assistant message dict, got {type(action).__name__}")
        calls = [c for c in action.get("tool_calls") or [] if isinstance(c, dict)]
        if calls:
            observations = [self._run_tool(c) for c in calls]
            return observations, 0.0, False, False, {"tool_calls": float(self._calls)}
        self._done = True
        answer = parse_answer(action.get("content") or "")
        correct = answer is not None and answer == int(self.task["answer"])
        info = {"correct": float(correct), "answered": float(answer is not None), "tool_calls": float(self._calls)}
        return [], float(correct), True, False, info


def register() -> None:
    """Register ``relax/PythonExec-v0`` in gymnasium's registry."""
    from relax_agent.envs import register as register_env

    register_env(id=ENV_ID, entry_point="relax_agent.envs.python_exec:PythonExecEnv")
