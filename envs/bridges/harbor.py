"""``relax/Harbor-v0``: a `Harbor <https://harborframework.com/docs/tasks>`_ task folder (or a folder of
them) as a multi-turn agent environment in relax-agent's own Docker sandbox.

    env = relax_agent.envs.make("harbor:examples/harbor/sum-numbers")   # = relax/Harbor-v0, task_dir=...
    messages, info = env.reset(seed=0)        # instruction.md; info["tools"]: the bash tool
    env.step({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]})
    env.step({"role": "assistant", "content": "done"})   # no tool call: tests/test.sh runs, its reward ends it
    env.close()                                         # the container is removed

The task's container starts at the episode's first ``bash`` call (or at the verifier, when the policy
answers at once) from the task's image (:mod:`.harbor_docker`: built from ``environment/Dockerfile``
and cached); its limits are the task's ``[environment]`` requests capped by ``sandbox`` (``cpus``,
``memory_mb``, ``storage_mb`` -> ``workdir_mb``), with no network. When the policy replies without a
tool call, or after ``max_turns`` tool turns, or once the ``[agent] timeout_sec`` of command time is
spent, ``tests/`` is copied to ``/tests`` and ``bash /tests/test.sh`` runs in the working directory
(``[verifier] timeout_sec``, ``[verifier.env]``); ``/logs/verifier/reward.json`` (its ``reward``) or
``reward.txt`` is the episode reward. A missing or malformed reward file, or a verifier past its
timeout, gives reward 0.0 with the status and reason in the step's info (:class:`~.harbor_task.Verdict`).
``solution/solve.sh`` is never shown to the policy; :meth:`HarborEnv.oracle_actions` replays it through
the same tool for tests. Task-folder problems are :class:`~relax_agent.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from relax_agent.envs.base import TextEnv
from relax_agent.envs.bfcl.data import check_split_args, split_tasks
from relax_agent.envs.bridges.harbor_task import HarborTask, Verdict, find_tasks, parse_reward, read_task, resolve_env
from relax_agent.envs.python_exec import format_result
from relax_agent.envs.tool_env import action_calls
from relax_agent.errors import ConfigError, DataError, EnvError, SandboxError
from relax_agent.sandboxes import Sandbox, SandboxConfig, run_sync

ENV_ID = "relax/Harbor-v0"
TOOL_NAME = "bash"
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run a bash command in the task's container (no network) and return its output. Each call "
                       "starts in the working directory with a fresh shell: only files persist between calls.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command(s) to run."}},
            "required": ["command"],
        },
    },
}
INSTRUCTION = ("Work on the task with the bash tool. When you are finished, reply without a tool call: "
               "the task's tests then check the container.")
PATH_VAR = "RELAX_HARBOR_PATH"
"""Folders (``os.pathsep``-separated) whose task folders :func:`available` lists; default ``examples/harbor``."""
_BACKENDS = ("docker", "fake")


class HarborEnv(TextEnv):
    """Harbor tasks with a sandboxed ``bash`` tool, scored by the task's own ``tests/test.sh``.

    Args:
        task_dir: a task folder, or a folder of task folders (relative paths from the working directory).
        sandbox: a :class:`SandboxConfig` or its dict: the backend (``docker``; ``fake`` runs no image and no
            verifier, for tests) and the caps on the task's requests (``cpus``, ``memory_mb``, ``workdir_mb``,
            ``max_timeout_s``); its ``image`` and ``workdir`` are the task's.
        split: the split ``reset`` draws from when no task is given ("train" or "heldout").
        heldout_fraction: share of a dataset's tasks held out (by a hash of the task's name); a single
            task folder is all train.
        max_turns: tool turns before the verifier runs anyway (the episode is then truncated).
        command_timeout_s: longest run of one ``bash`` call (also capped by what is left of ``[agent]
            timeout_sec``).
        max_tool_calls_per_turn: calls run per assistant message; later ones get an error message.
        max_observation_chars: longest tool observation returned to the policy.

    Raises:
        ConfigError: a malformed task folder (naming the file), a backend other than docker or fake, a
            sandbox pool, or an argument outside the values above.
    """

    reward_description = (
        "the task's own tests/test.sh, run in the container after the agent finishes: the 'reward' of "
        "/logs/verifier/reward.json, else the number in /logs/verifier/reward.txt; 0.0 (with the reason in "
        "info) when neither is written or readable, or when the tests run past [verifier] timeout_sec."
    )

    def __init__(self, task_dir: str, sandbox: SandboxConfig | dict[str, Any] | None = None, split: str = "train",
                 heldout_fraction: float = 0.2, max_turns: int = 16, command_timeout_s: float = 60.0,
                 max_tool_calls_per_turn: int = 4, max_observation_chars: int = 4000) -> None:
        super().__init__()
        try:
            self.sandbox_config = sandbox if isinstance(sandbox, SandboxConfig) else SandboxConfig(**(sandbox or {}))
        except ValueError as exc:
            raise ConfigError(f"env.kwargs.sandbox is invalid: {exc}") from None
        if self.sandbox_config.backend not in _BACKENDS:
            raise ConfigError(f"sandbox.backend={self.sandbox_config.backend!r}: Harbor tasks run in their Dockerfile's "
                              f"image; expected one of {list(_BACKENDS)} (fake: tests only, no image, no verifier)")
        if self.sandbox_config.pool.size > 0:
            raise ConfigError("sandbox.pool.size must be 0 for relax/Harbor-v0: each episode starts a fresh container "
                              "from its task's image")
        check_split_args(split, heldout_fraction)
        if max_turns < 1 or not command_timeout_s > 0 or max_tool_calls_per_turn < 1 or max_observation_chars < 100:
            raise ConfigError(f"need max_turns >= 1, command_timeout_s > 0, max_tool_calls_per_turn >= 1 and "
                              f"max_observation_chars >= 100; got {max_turns}, {command_timeout_s}, "
                              f"{max_tool_calls_per_turn}, {max_observation_chars}")
        found, self.is_dataset = find_tasks(task_dir)
        self.task_dir, self.split, self.heldout_fraction = str(task_dir), split, heldout_fraction
        self.max_turns, self.command_timeout_s = max_turns, float(command_timeout_s)
        self.max_tool_calls_per_turn, self.max_observation_chars = max_tool_calls_per_turn, max_observation_chars
        self._specs = {t.name: t for t in found}
        self._all = [{"id": t.name, "task_dir": str(t.path)} for t in found]
        if self.is_dataset and not split_tasks(self._all, "train", heldout_fraction):
            raise ConfigError(f"heldout_fraction={heldout_fraction} puts all {len(found)} tasks of {task_dir!r} in the "
                              "held-out split; lower it")
        self.sandbox: Sandbox | None = None
        self.harbor_task: HarborTask | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._done = True
        self._turns = self._calls = 0
        self._agent_s = 0.0

    # -- tasks -------------------------------------------------------------------------------
    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """``{"id": <folder name>, "task_dir": <absolute path>}`` per task of ``split``; a single task folder
        is the train split (held-out: none).

        Raises:
            DataError: unknown split.
        """
        if not self.is_dataset:
            if split not in ("train", "heldout"):
                raise DataError(f"unknown split {split!r}; expected one of ['train', 'heldout']")
            return list(self._all) if split == "train" else []
        return split_tasks(self._all, split, self.heldout_fraction)

    def _spec_of(self, task: dict[str, Any]) -> HarborTask:
        spec = self._specs.get(str(task.get("id")))
        if spec is not None:
            return spec
        if isinstance(task.get("task_dir"), str):
            return read_task(task["task_dir"])
        raise DataError(f"Harbor task {task.get('id')!r} is not in {self.task_dir!r} and names no task_dir; "
                        f"known: {sorted(self._specs)[:10]}")

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        spec = self._spec_of(task)
        self._release()
        with self._lock:
            self._closed = False
        self.harbor_task, self._done = spec, False
        self._turns = self._calls = 0
        self._agent_s = 0.0
        messages = [{"role": "user", "content": f"{spec.instruction}\n\n{INSTRUCTION}"}]
        return messages, {"tools": [json.loads(json.dumps(TOOL_SCHEMA))], "task_id": spec.name}

    # -- the container -----------------------------------------------------------------------
    def _task_config(self, spec: HarborTask) -> tuple[SandboxConfig, Any]:
        """The sandbox config of ``spec`` (task requests capped by ``sandbox``) and its backend."""
        cap = self.sandbox_config
        updates: dict[str, Any] = {
            "memory_mb": max(16, min(spec.memory_mb or cap.memory_mb, cap.memory_mb)),
            "cpus": min(spec.cpus or cap.cpus, cap.cpus),
            "workdir_mb": max(1, min(spec.storage_mb or cap.workdir_mb, cap.workdir_mb)),
        }
        env = resolve_env(spec.environment_env, f"{spec.path / 'task.toml'} [environment.env]")
        if cap.backend == "fake":
            config = SandboxConfig(**{**cap.model_dump(), **updates, "workdir": spec.workdir or "/app",
                                      "env": {**env, **cap.env}})
            return config, config.build()
        from relax_agent.envs.bridges.harbor_docker import HarborDockerBackend, build_image

        image = build_image(spec, cap)
        config = SandboxConfig(**{**cap.model_dump(), **updates, "image": image.tag, "workdir": image.workdir,
                                  "env": {**image.env, **env, **cap.env}})
        tests_mb = 8 + sum(p.stat().st_size for p in spec.tests_dir.rglob("*") if p.is_file()) // 2**20 * 2
        return config, HarborDockerBackend(config, spec.name, tests_mb=tests_mb)

    def _ready(self) -> Sandbox:
        """The episode's container, started (and its working directory unpacked) on first use.

        Raises:
            EnvError: the env was closed (an abandoned episode's late step).
            SandboxError / ConfigError: the container or its image could not be made.
        """
        if self.sandbox is not None:
            return self.sandbox
        assert self.harbor_task is not None
        with self._lock:
            if self._closed:
                raise EnvError(f"{type(self).__name__} was closed; its episode cannot go on")
        config, backend = self._task_config(self.harbor_task)
        sandbox = run_sync(backend.create())
        try:
            if config.backend == "docker":
                from relax_agent.envs.bridges.harbor_docker import unpack_workdir

                run_sync(unpack_workdir(sandbox, config.workdir))
        except BaseException:
            run_sync(sandbox.close())
            raise
        with self._lock:
            if self._closed:  # closed while the container started: do not keep it
                run_sync(sandbox.close())
                raise EnvError(f"{type(self).__name__} was closed while its container started")
            self.sandbox = sandbox
        return sandbox

    def _release(self) -> None:
        with self._lock:
            sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            run_sync(sandbox.close())

    def close(self) -> None:
        """Remove the episode's container (idempotent; safe while a step runs in another thread)."""
        with self._lock:
            self._closed = True
        self._release()
        super().close()

    # -- stepping ----------------------------------------------------------------------------
    def _run_bash(self, call: Any) -> dict[str, Any]:
        call = call if isinstance(call, dict) else {}
        raw_function = call.get("function")
        function = raw_function if isinstance(raw_function, dict) else call
        name, args = function.get("name"), function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        reply = {"role": "tool", "tool_call_id": str(call.get("id") or ""), "name": str(name or "")}
        if name != TOOL_NAME:
            return {**reply, "content": f"error: unknown tool {name!r}; the only tool is {TOOL_NAME}"}
        if not isinstance(args, dict) or not isinstance(args.get("command"), str) or not args["command"].strip():
            return {**reply, "content": 'error: arguments must be a JSON object {"command": "<bash command>"}'}
        assert self.harbor_task is not None
        left = self.harbor_task.agent_timeout_s - self._agent_s
        if left <= 0:
            return {**reply, "content": "error: the task's agent time ([agent] timeout_sec) is spent"}
        timeout = min(self.command_timeout_s, left, self.sandbox_config.max_timeout_s)
        self._calls += 1
        sandbox = self._ready()
        try:
            res = run_sync(sandbox.exec(["bash", "-c", args["command"]], timeout_s=timeout))
        except SandboxError:
            self._release()  # a broken container is not reused; the episode fails with the cause
            raise
        self._agent_s += min(res.duration_s, timeout)
        return {**reply, "content": format_result(res, timeout, self.max_observation_chars)}

    def step(self, action: dict[str, Any]):
        """Run the message's ``bash`` calls, or (a message without tool calls) run the verifier.

        Returns:
            With tool calls: ``(tool messages, 0.0, False, False, info)``; at ``max_turns`` tool turns, or
            once the agent time is spent, the verifier runs too: ``(tool messages, reward, False, True,
            info)``. Without: ``([], reward, True, False, info)``. The verifier's info: ``verifier_ok``,
            ``verifier_exit_code``, ``verifier_status``, ``reason``, ``tool_calls`` and ``reward_json/<key>``
            for the other numbers of ``reward.json``.

        Raises:
            EnvError: ``step`` before ``reset``, after the episode ended, or a non-dict action.
            SandboxError: the container failed (an infrastructure failure, not a score).
        """
        if self.harbor_task is None or self._done:
            raise EnvError(f"{type(self).__name__}.step() needs a fresh episode: call reset() first")
        calls = action_calls(action)
        if not calls and not action.get("parse_errors"):
            self._done = True
            return [], *self._verify(truncated=False)
        observations = [self._run_bash(c) for c in calls[: self.max_tool_calls_per_turn]]
        observations += [{"role": "tool", "tool_call_id": str(c.get("id") or "") if isinstance(c, dict) else "",
                          "name": TOOL_NAME, "content": f"error: at most {self.max_tool_calls_per_turn} tool calls "
                                                        "per turn; this call was not run"}
                         for c in calls[self.max_tool_calls_per_turn:]]
        observations += [{"role": "tool", "tool_call_id": "", "name": "", "content":
                          f"error: could not parse a tool call: {e}"} for e in action.get("parse_errors") or []]
        self._turns += 1
        assert self.harbor_task is not None
        if self._turns >= self.max_turns or self._agent_s >= self.harbor_task.agent_timeout_s:
            self._done = True
            return observations, *self._verify(truncated=True)
        return observations, 0.0, False, False, {"tool_calls": float(self._calls)}

    def _verify(self, truncated: bool) -> tuple[float, bool, bool, dict[str, Any]]:
        try:
            verdict, code = self.run_verifier()
        finally:
            self._release()  # the episode is over: its container goes now, not at close()
        info: dict[str, Any] = {"tool_calls": float(self._calls), "verifier_ok": float(verdict.status == "ok"),
                                "verifier_exit_code": float(code if code is not None else -1),
                                "verifier_status": verdict.status, "reason": verdict.reason,
                                "agent_timed_out": float(self.harbor_task is not None and self._agent_s >= self.harbor_task.agent_timeout_s)}
        info.update({f"reward_json/{k}": v for k, v in verdict.extras.items()})
        return float(verdict.reward), not truncated, truncated, info

    def run_verifier(self) -> tuple[Verdict, int | None]:
        """Copy ``tests/`` to ``/tests``, run ``bash /tests/test.sh`` and read its reward files.

        Returns:
            The verdict and the script's exit code (None when it did not run).

        Raises:
            SandboxError: the container broke (not a score); a failure to stage the tests in a working
                container is a verdict with status "error".
        """
        spec = self.harbor_task
        assert spec is not None
        sandbox = self._ready()
        try:
            staging = run_sync(_stage_tests(sandbox, spec))
        except SandboxError as exc:
            if getattr(sandbox, "broken", None) or getattr(sandbox, "closed", False):
                raise
            return Verdict(0.0, "error", f"could not copy tests/ into the container: {exc}"), None
        if staging is not None:
            return staging, None
        env = resolve_env(spec.verifier_env, f"{spec.path / 'task.toml'} [verifier.env]")
        timeout = min(spec.verifier_timeout_s, self.sandbox_config.max_timeout_s)
        res = run_sync(sandbox.exec(["bash", "/tests/test.sh"], timeout_s=timeout, env=env))
        if res.timed_out:
            return Verdict(0.0, "timeout", f"tests/test.sh did not finish within [verifier] timeout_sec={timeout:g} s"), None
        texts = [_read_text(sandbox, f"/logs/verifier/{name}") for name in ("reward.json", "reward.txt")]
        unreadable = [t for t in texts if isinstance(t, Verdict)]
        if unreadable:
            return unreadable[0], res.exit_code
        verdict = parse_reward(*texts)  # type: ignore[arg-type]
        if verdict.status == "missing":
            tail = (res.stderr or res.stdout).strip()[-300:]
            verdict = Verdict(0.0, "missing", f"{verdict.reason} (exit {res.exit_code}){': ' + tail if tail else ''}")
        return verdict, res.exit_code

    def oracle_actions(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The scripted episode of ``task``'s ``solution/solve.sh`` (for tests and demonstrations; the policy
        never sees it): one ``bash`` call running the script's text, then a final message.

        Raises:
            DataError: the task has no ``solution/solve.sh``.
        """
        solution = self._spec_of(task).solution
        if solution is None:
            raise DataError(f"Harbor task {task.get('id')!r} has no solution/solve.sh")
        call = {"id": "call_0", "type": "function",
                "function": {"name": TOOL_NAME, "arguments": json.dumps({"command": solution.read_text()})}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "assistant", "content": "Done."}]


async def _stage_tests(sandbox: Sandbox, spec: HarborTask) -> Verdict | None:
    """Empty ``/tests`` and ``/logs``, copy ``tests/`` into ``/tests`` and make ``/logs/verifier``.

    Returns:
        None when staged; a verdict with status "error" when the container refused (its exit code and output).
    """
    if sandbox.config.backend == "docker":
        wipe = ("chmod -R u+rwX /tests /logs 2>/dev/null; find /tests /logs -mindepth 1 -delete 2>/dev/null; "
                "mkdir -p /logs/verifier /logs/agent")
        res = await sandbox.exec(["/bin/sh", "-c", wipe], timeout_s=60.0, cwd="/")
        if not res.ok:
            return Verdict(0.0, "error", f"could not empty /tests and /logs (exit {res.exit_code}): {res.stderr.strip()[-300:]}")
    executables = []
    for path in sorted(p for p in spec.tests_dir.rglob("*") if p.is_file()):
        target = f"/tests/{path.relative_to(spec.tests_dir).as_posix()}"
        await sandbox.write_file(target, path.read_bytes())
        if os.access(path, os.X_OK):
            executables.append(target)
    if executables:
        res = await sandbox.exec(["chmod", "+x", *executables], timeout_s=60.0, cwd="/")
        if not res.ok:
            return Verdict(0.0, "error", f"chmod +x of tests/ failed (exit {res.exit_code}): {res.stderr.strip()[-300:]}")
    return None


def _read_text(sandbox: Sandbox, path: str) -> str | Verdict | None:
    """The text of ``path`` in the container; None when it does not exist, a "malformed" verdict when it
    cannot be read (a directory, too large, not UTF-8 text...).

    Raises:
        SandboxError: the container broke.
    """
    try:
        data = run_sync(sandbox.read_file(path))
    except SandboxError as exc:
        if getattr(sandbox, "broken", None) or getattr(sandbox, "closed", False):
            raise
        if "No such file" in str(exc):
            return None
        return Verdict(0.0, "malformed", f"{path} could not be read: {exc}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return Verdict(0.0, "malformed", f"{path} is not UTF-8 text: {data[:40]!r}")


def available() -> list[str]:
    """The task folders under :data:`PATH_VAR`'s folders (default ``examples/harbor`` in the working
    directory), as ``harbor:<name>`` takes them; [] when there is none. Harbor needs no package."""
    roots = [r for r in os.environ.get(PATH_VAR, os.path.join("examples", "harbor")).split(os.pathsep) if r]
    names: list[str] = []
    for root in roots:
        folder = Path(root)
        if (folder / "task.toml").is_file():
            names.append(root)
        elif folder.is_dir():
            names += [os.path.join(root, p.name) for p in sorted(folder.iterdir())
                      if p.is_dir() and not p.name.startswith(".") and (p / "task.toml").is_file()]
    return names


__all__ = ["ENV_ID", "HarborEnv", "TOOL_SCHEMA", "available"]
