"""Harbor task folders, read directly (Harbor's own package needs Python >= 3.12 and is not used).

A task is a folder::

    my-task/
      instruction.md          # the task text for the agent
      task.toml               # [metadata], [verifier] timeout_sec, env; [agent] timeout_sec;
                              # [environment] build_timeout_sec, docker_image, cpus, memory_mb (or
                              # memory = "2G"), storage_mb (or storage), workdir, env, allow_internet
      environment/Dockerfile  # the container the agent works in (unless docker_image is set)
      tests/test.sh           # run after the agent; writes /logs/verifier/reward.txt or reward.json
      solution/solve.sh       # optional reference solution (never shown to the policy)

A dataset is a folder whose subfolders are task folders. :func:`find_tasks` reads either;
:func:`parse_reward` turns the verifier's reward files into a :class:`Verdict`. Every problem
with a task folder is a :class:`~relax_agent.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_agent.errors import ConfigError

TASK_TOML = "task.toml"
INSTRUCTION_MD = "instruction.md"
DOCKERFILE = "environment/Dockerfile"
TEST_SH = "tests/test.sh"
SOLVE_SH = "solution/solve.sh"
DEFAULT_TIMEOUT_S = 600.0
"""Harbor's default ``[agent]``, ``[verifier]`` and ``[environment] build`` timeouts (seconds)."""
REWARD_JSON = "/logs/verifier/reward.json"
REWARD_TXT = "/logs/verifier/reward.txt"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)
_MB_PER_UNIT = {"": 1.0, "k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0 * 1024}
_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task folder, read and checked.

    Attributes:
        name: the folder's name (Harbor's task id).
        path: the folder, absolute.
        instruction: ``instruction.md``'s text.
        agent_timeout_s / verifier_timeout_s / build_timeout_s: ``[agent]``, ``[verifier]`` and
            ``[environment] build_timeout_sec`` (Harbor's default 600 s each).
        cpus / memory_mb / storage_mb: ``[environment]`` requests; None when not set.
        workdir: ``[environment] workdir``; None: the image's ``WORKDIR``.
        docker_image: ``[environment] docker_image`` (a prebuilt image used instead of the Dockerfile).
        allow_internet: what the task asks for (the sandbox has no network either way).
        environment_env / verifier_env: ``[environment.env]`` and ``[verifier.env]`` (``${VAR}``
            templates unresolved).
        metadata: ``[metadata]`` as written.
    """

    name: str
    path: Path
    instruction: str
    agent_timeout_s: float = DEFAULT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_TIMEOUT_S
    build_timeout_s: float = DEFAULT_TIMEOUT_S
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    workdir: str | None = None
    docker_image: str | None = None
    allow_internet: bool = True
    environment_env: dict[str, str] = field(default_factory=dict)
    verifier_env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def environment_dir(self) -> Path:
        """``environment/``: the Docker build context."""
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        """``tests/``: copied to ``/tests`` in the container before ``tests/test.sh`` runs."""
        return self.path / "tests"

    @property
    def solution(self) -> Path | None:
        """``solution/solve.sh`` when the task has one."""
        path = self.path / SOLVE_SH
        return path if path.is_file() else None


@dataclass(frozen=True)
class Verdict:
    """What the verifier's reward files say.

    Attributes:
        reward: the episode reward (0.0 unless ``status`` is "ok").
        status: "ok", "missing" (no reward file), "malformed" (unreadable, not a finite number, no
            ``reward`` key), "timeout" (``tests/test.sh`` ran past ``[verifier] timeout_sec``) or
            "error" (the tests could not be staged or run).
        reason: one line saying why, for the episode record.
        source: the file the reward came from (``reward.json`` or ``reward.txt``), else None.
        extras: the other numeric entries of ``reward.json``.
    """

    reward: float
    status: str
    reason: str
    source: str | None = None
    extras: dict[str, float] = field(default_factory=dict)


def _section(data: dict[str, Any], key: str, file: Path) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{file}: [{key}] must be a table, got {type(value).__name__}")
    return value


def _seconds(table: dict[str, Any], key: str, where: str, file: Path) -> float:
    value = table.get(key, DEFAULT_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{file}: {where}.{key}={value!r}; expected a positive number of seconds")
    return float(value)


def parse_size_mb(value: Any, where: str, file: Path | str) -> int:
    """Megabytes from ``2048`` (MB), ``"512M"``, ``"4G"``, ``"1.5GiB"`` (a bare number is MB).

    Raises:
        ConfigError: not a positive size, naming ``file`` and ``where`` (the key).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        mb = float(value)
    else:
        match = _SIZE.match(value) if isinstance(value, str) else None
        if match is None:
            raise ConfigError(f"{file}: {where}={value!r}; expected megabytes (2048) or a size such as '4G' or '512M'")
        mb = float(match.group(1)) * _MB_PER_UNIT[match.group(2).lower()]
    if not math.isfinite(mb) or mb <= 0:
        raise ConfigError(f"{file}: {where}={value!r}; expected a positive size")
    return max(1, int(mb))


def _env_table(table: dict[str, Any], where: str, file: Path) -> dict[str, str]:
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float)) and
                                            not isinstance(v, bool) for k, v in env.items()):
        raise ConfigError(f"{file}: {where}.env must map names to strings, got {env!r}")
    return {k: str(v) for k, v in env.items()}


def _environment(env: dict[str, Any], file: Path) -> dict[str, Any]:
    """The ``[environment]`` fields :class:`HarborTask` keeps."""
    out: dict[str, Any] = {"build_timeout_s": _seconds(env, "build_timeout_sec", "[environment]", file)}
    cpus = env.get("cpus")
    if cpus is not None:
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not math.isfinite(cpus) or cpus <= 0:
            raise ConfigError(f"{file}: [environment].cpus={cpus!r}; expected a positive number")
        out["cpus"] = float(cpus)
    for key, legacy in (("memory_mb", "memory"), ("storage_mb", "storage")):
        if env.get(key) is not None:
            out[key] = parse_size_mb(env[key], f"[environment].{key}", file)
        elif env.get(legacy) is not None:
            out[key] = parse_size_mb(env[legacy], f"[environment].{legacy}", file)
    gpus = env.get("gpus", 0)
    if gpus:
        raise ConfigError(f"{file}: [environment].gpus={gpus!r}; relax-agent's sandbox has no GPUs (set 0)")
    workdir = env.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/") or workdir.rstrip("/") == ""):
        raise ConfigError(f"{file}: [environment].workdir={workdir!r}; expected an absolute path other than /")
    out["workdir"] = workdir.rstrip("/") if workdir else None
    image = env.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise ConfigError(f"{file}: [environment].docker_image={image!r}; expected an image name")
    out["docker_image"] = image or None
    network = env.get("network_mode")
    out["allow_internet"] = bool(env.get("allow_internet", True)) and network not in ("none", "no-network")
    out["environment_env"] = _env_table(env, "[environment]", file)
    return out


def _toml_loads(text: str) -> dict[str, Any]:
    """``tomllib.loads`` (Python >= 3.11), else the ``tomli`` package's.

    Raises:
        ConfigError: neither is available.
    """
    try:
        import tomllib as toml
    except ImportError:  # Python 3.10
        try:
            import tomli as toml  # type: ignore[no-redef]
        except ImportError:
            raise ConfigError("reading Harbor's task.toml needs Python >= 3.11 or the tomli package "
                              "(pip install tomli)") from None
    return toml.loads(text)


def read_task(path: str | Path) -> HarborTask:
    """Read one task folder.

    Raises:
        ConfigError: naming the file: no ``task.toml``, TOML that does not parse or holds a value of the
            wrong type, no (or an empty) ``instruction.md``, no ``tests/test.sh``, neither
            ``environment/Dockerfile`` nor ``[environment] docker_image``, or a feature the bridge does
            not run (multi-step ``[[steps]]``, a separate verifier, ``docker-compose.yaml``, GPUs).
    """
    folder = Path(path).expanduser().resolve()
    toml_path = folder / TASK_TOML
    if not toml_path.is_file():
        raise ConfigError(f"{toml_path}: missing; a Harbor task folder needs task.toml, instruction.md, "
                          "environment/Dockerfile and tests/test.sh")
    try:
        data = _toml_loads(toml_path.read_text(encoding="utf-8"))
    except ValueError as exc:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{toml_path}: not valid TOML ({exc})") from None
    if data.get("steps"):
        raise ConfigError(f"{toml_path}: multi-step tasks ([[steps]]) are not supported by the Harbor bridge")
    verifier = _section(data, "verifier", toml_path)
    if verifier.get("environment_mode") == "separate" or "environment" in verifier:
        raise ConfigError(f"{toml_path}: a separate verifier environment ([verifier] environment_mode / "
                          "[verifier.environment]) is not supported; the verifier runs in the agent's container")
    env = _environment(_section(data, "environment", toml_path), toml_path)
    if (folder / "environment" / "docker-compose.yaml").is_file() and env["docker_image"] is None:
        raise ConfigError(f"{folder / 'environment' / 'docker-compose.yaml'}: multi-container (docker compose) "
                          "tasks are not supported; the bridge builds environment/Dockerfile")
    instruction_path = folder / INSTRUCTION_MD
    if not instruction_path.is_file():
        raise ConfigError(f"{instruction_path}: missing; it holds the task text for the agent")
    instruction = instruction_path.read_text(encoding="utf-8", errors="replace").strip()
    if not instruction:
        raise ConfigError(f"{instruction_path}: empty; it must hold the task text for the agent")
    if not (folder / TEST_SH).is_file():
        raise ConfigError(f"{folder / TEST_SH}: missing; the verifier runs it to write /logs/verifier/reward.txt")
    if env["docker_image"] is None and not (folder / DOCKERFILE).is_file():
        raise ConfigError(f"{folder / DOCKERFILE}: missing (and task.toml sets no [environment] docker_image); "
                          "it defines the container the agent works in")
    metadata = _section(data, "metadata", toml_path)
    return HarborTask(
        name=folder.name, path=folder, instruction=instruction,
        agent_timeout_s=_seconds(_section(data, "agent", toml_path), "timeout_sec", "[agent]", toml_path),
        verifier_timeout_s=_seconds(verifier, "timeout_sec", "[verifier]", toml_path),
        verifier_env=_env_table(verifier, "[verifier]", toml_path), metadata=dict(metadata), **env)


def find_tasks(path: str | Path) -> tuple[list[HarborTask], bool]:
    """The tasks at ``path``: ``([task], False)`` for a task folder, ``(tasks, True)`` for a folder of
    task folders (its subfolders holding a ``task.toml``, by name; hidden ones skipped).

    Raises:
        ConfigError: ``path`` is not a folder, holds no task, or one of its tasks is malformed (see
            :func:`read_task`).
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"harbor task_dir={str(path)!r} is not a folder (relative paths start at the working "
                          f"directory {os.getcwd()}); expected a task folder or a folder of task folders")
    if (folder / TASK_TOML).is_file():
        return [read_task(folder)], False
    children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and (p / TASK_TOML).is_file())
    if not children:
        raise ConfigError(f"harbor task_dir={str(path)!r}: no task.toml in it or in any of its subfolders; "
                          "expected a task folder or a folder of task folders")
    return [read_task(p) for p in children], True


def resolve_env(values: dict[str, str], where: str) -> dict[str, str]:
    """``values`` with ``${VAR}`` / ``${VAR:-default}`` replaced from this process's environment (as
    Harbor resolves ``[verifier.env]``).

    Raises:
        ConfigError: a ``${VAR}`` without default names a variable that is not set.
    """
    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ConfigError(f"{where}: ${{{name}}} is not set in the environment and has no default (${{{name}:-...}})")

    return {k: _TEMPLATE.sub(sub, v) for k, v in values.items()}


def folder_digest(folder: Path, *salt: str) -> str:
    """SHA-256 (hex) of every file under ``folder``: relative paths, executable bits and contents, plus ``salt``."""
    h = hashlib.sha256("\0".join(salt).encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(folder).as_posix()
        h.update(f"\0{rel}\0{os.access(path, os.X_OK)}\0".encode())
        h.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    return h.hexdigest()


def dockerfile_bases(text: str) -> list[str]:
    """The images a Dockerfile's ``FROM`` lines pull (earlier stages, ``scratch`` and ``$ARG`` names left out)."""
    bases, stages = [], set()
    for line in text.replace("\\\n", " ").splitlines():
        words = [w for w in line.split() if not w.startswith("--")]
        if not words or words[0].upper() != "FROM" or len(words) < 2:
            continue
        image = words[1]
        if len(words) >= 4 and words[2].upper() == "AS":
            stages.add(words[3].lower())
        if image.lower() not in stages and image != "scratch" and "$" not in image:
            bases.append(image)
    return bases


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def parse_reward(json_text: str | None, txt_text: str | None) -> Verdict:
    """The verdict of the verifier's reward files (each None when absent).

    As Harbor reads them: ``reward.json`` (an object of numbers; its ``"reward"`` is the reward, the other
    numbers are kept as ``extras``) wins over ``reward.txt`` (one number); a ``reward.json`` without a
    ``"reward"`` key falls back to ``reward.txt``. Anything else is a non-"ok" verdict with reward 0.0.
    """
    extras: dict[str, float] = {}
    if json_text is not None:
        try:
            data = json.loads(json_text)
        except ValueError as exc:
            return Verdict(0.0, "malformed", f"{REWARD_JSON} is not JSON ({exc}): {json_text[:80]!r}")
        if not isinstance(data, dict):
            return Verdict(0.0, "malformed", f"{REWARD_JSON} must be an object of numbers, got {json_text[:80]!r}")
        extras = {str(k): v for k, v in ((k, _number(v)) for k, v in data.items()) if v is not None}
        if "reward" in data:
            reward = _number(data["reward"])
            if reward is None:
                return Verdict(0.0, "malformed", f"{REWARD_JSON}: 'reward' must be a finite number, got {data['reward']!r}")
            del extras["reward"]
            return Verdict(reward, "ok", f"{REWARD_JSON}: reward {reward:g}", "reward.json", extras)
        if txt_text is None:
            return Verdict(0.0, "malformed", f"{REWARD_JSON} has no 'reward' key (keys {sorted(data)[:8]}) and "
                           f"there is no {REWARD_TXT}", None, extras)
    if txt_text is None:
        return Verdict(0.0, "missing", f"tests/test.sh wrote neither {REWARD_TXT} nor {REWARD_JSON}")
    try:
        reward = float(txt_text.strip())
    except ValueError:
        reward = math.nan
    if not math.isfinite(reward):
        return Verdict(0.0, "malformed", f"{REWARD_TXT} must hold one finite number, got {txt_text[:80]!r}", None, extras)
    return Verdict(reward, "ok", f"{REWARD_TXT}: reward {reward:g}", "reward.txt", extras)


__all__ = ["DEFAULT_TIMEOUT_S", "HarborTask", "REWARD_JSON", "REWARD_TXT", "Verdict", "dockerfile_bases",
           "find_tasks", "folder_digest", "parse_reward", "parse_size_mb", "read_task", "resolve_env"]
