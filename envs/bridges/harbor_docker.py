"""Docker side of the Harbor bridge: build a task's image, and start its container in relax-agent's sandbox.

**Images.** A task's ``environment/`` folder is built with docker-py (its ``Dockerfile``, or the prebuilt
``[environment] docker_image``), then a one-layer image on top of it packs the image's working directory
into ``/.relax-harbor/workdir.tar``: the sandbox's root file system is read-only and its working directory
a tmpfs, which would hide what the Dockerfile put there, so each container unpacks that archive into its
tmpfs working directory when it starts. The result is tagged ``relax-agent/harbor-env:<hash>``, the hash
being that of the environment folder (so a changed Dockerfile or file builds anew, and tasks with the same
environment share one image), and labelled ``relax-agent.image=harbor``. A ``FROM`` image that is neither
on the local daemon nor pullable is a :class:`~relax_agent.errors.ConfigError` naming the Dockerfile and
the image.

**Containers.** :class:`HarborDockerBackend` is relax-agent's own Docker backend (no network, read-only
root, all capabilities dropped, commands as ``sandbox.user``, labels the reaper knows, a TTL) with two
more tmpfs mounts the verifier needs: ``/tests`` and ``/logs``.
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass
from typing import Any

from relax_agent.envs.bridges.harbor_task import DOCKERFILE, HarborTask, dockerfile_bases, folder_digest
from relax_agent.errors import ConfigError, EnvError, SandboxError
from relax_agent.sandboxes import Sandbox, SandboxConfig
from relax_agent.sandboxes.docker import DockerBackend, docker_client
from relax_agent.sandboxes.image import IMAGE_LABEL

IMAGE_REPO = "relax-agent/harbor-env"
SEED_TAR = "/.relax-harbor/workdir.tar"
"""The image's working directory, packed at build time; unpacked into the tmpfs working directory."""
LABEL_WORKDIR = "relax-agent.harbor.workdir"
LABEL_SOURCE = "relax-agent.harbor.source"
LABEL_TASK = "relax-agent.harbor.task"
RECIPE = "relax-harbor-image-v1"
"""Salt of the image hash: bump it when the seed layer below changes."""
_SEED_DOCKERFILE = """\
FROM {base}
USER root
RUN mkdir -p {workdir} /.relax-harbor && tar -C {workdir} -cf {tar} .
"""
DEFAULT_WORKDIR = "/app"
"""Working directory when neither task.toml nor the image names one (or the image's is ``/``)."""


@dataclass(frozen=True)
class TaskImage:
    """A built task image.

    Attributes:
        tag: ``relax-agent/harbor-env:<hash>``.
        workdir: where the agent's commands and ``tests/test.sh`` run (a tmpfs seeded from the image).
        env: the image's ``ENV`` (``PATH`` and the like; ``HOME`` left out: it is the working directory).
    """

    tag: str
    workdir: str
    env: dict[str, str]


_lock = threading.Lock()
_building: dict[str, threading.Lock] = {}
_keys: dict[tuple[Any, ...], str] = {}


def _image_env(attrs: dict[str, Any]) -> dict[str, str]:
    pairs = (e.partition("=") for e in (attrs.get("Config") or {}).get("Env") or [])
    return {k: v for k, sep, v in pairs if sep and k not in ("HOME", "HOSTNAME")}


def _from_attrs(tag: str, attrs: dict[str, Any]) -> TaskImage:
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    return TaskImage(tag, labels.get(LABEL_WORKDIR, DEFAULT_WORKDIR), _image_env(attrs))


def _stream_build(client: Any, what: str, deadline: float, **kwargs: Any) -> str:
    """Run one ``docker build`` (low-level API, streamed); returns the image id.

    Raises:
        EnvError: the build failed or ran past ``deadline`` (the log's tail in the message).
    """
    log: list[str] = []
    image_id = None
    stream = client.api.build(decode=True, rm=True, forcerm=True, **kwargs)
    try:
        for chunk in stream:
            if "error" in chunk:
                raise _BuildFailed(str(chunk["error"]).strip(), "".join(log)[-2000:])
            if "stream" in chunk:
                log.append(str(chunk["stream"]))
            aux = chunk.get("aux")
            if isinstance(aux, dict) and "ID" in aux:
                image_id = aux["ID"]
            if time.monotonic() > deadline:
                raise EnvError(f"{what}: docker build ran past [environment] build_timeout_sec; log tail:\n"
                               f"{''.join(log)[-2000:]}")
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    if image_id is None:
        for line in reversed("".join(log).splitlines()):
            if line.startswith("Successfully built "):
                image_id = line.split()[-1]
                break
    if image_id is None:
        raise EnvError(f"{what}: docker build reported no image id; log tail:\n{''.join(log)[-2000:]}")
    return str(image_id)


class _BuildFailed(Exception):
    def __init__(self, error: str, log: str) -> None:
        super().__init__(error)
        self.error, self.log = error, log


def _missing_bases(client: Any, task: HarborTask) -> list[str]:
    import docker.errors

    text = (task.path / DOCKERFILE).read_text(encoding="utf-8", errors="replace")
    missing = []
    for base in dockerfile_bases(text):
        try:
            client.images.get(base)
        except docker.errors.ImageNotFound:
            missing.append(base)
    return missing


def _base_image(client: Any, task: HarborTask, deadline: float) -> str:
    """The id of the task's own image: ``environment/Dockerfile`` built, or ``docker_image`` (pulled if absent).

    Raises:
        ConfigError: a ``FROM`` image (or ``docker_image``) is neither local nor pullable.
        EnvError: the build failed otherwise.
    """
    import docker.errors

    if task.docker_image is not None:
        try:
            return str(client.images.get(task.docker_image).id)
        except docker.errors.ImageNotFound:
            pass
        try:
            return str(client.images.pull(task.docker_image).id)
        except docker.errors.APIError as exc:
            raise ConfigError(f"{task.path / 'task.toml'}: [environment] docker_image={task.docker_image!r} is not "
                              f"on the local Docker daemon and could not be pulled ({exc}); docker load it first") from None
    dockerfile = task.path / DOCKERFILE
    try:
        return _stream_build(client, str(dockerfile), deadline, path=str(task.environment_dir),
                             dockerfile="Dockerfile", labels={IMAGE_LABEL: "harbor-base", LABEL_SOURCE: str(task.path)},
                             timeout=max(60, int(task.build_timeout_s)))
    except _BuildFailed as exc:
        missing = _missing_bases(client, task)
        if missing:
            raise ConfigError(f"{dockerfile}: FROM {missing[0]} is not on the local Docker daemon and could not be "
                              f"pulled ({exc.error}); pull or docker load it first, or change the FROM line") from None
        raise EnvError(f"{dockerfile}: docker build failed: {exc.error}\nlog tail:\n{exc.log}") from None


def _environment_key(task: HarborTask) -> str:
    """:func:`folder_digest` of the environment folder (and the task's image settings), recomputed only when
    a file's size, time or mode changed (every episode asks)."""
    files = sorted(p for p in task.environment_dir.rglob("*") if p.is_file())
    stamp = (str(task.environment_dir), task.docker_image, task.workdir,
             tuple((str(p), s.st_size, s.st_mtime_ns, s.st_mode) for p in files for s in (p.stat(),)))
    with _lock:
        if stamp in _keys:
            return _keys[stamp]
    key = folder_digest(task.environment_dir, RECIPE, task.docker_image or "", task.workdir or "")
    with _lock:
        _keys[stamp] = key
    return key


def build_image(task: HarborTask, config: SandboxConfig) -> TaskImage:
    """The task's image, built when the daemon does not have its tag yet (one build at a time per image).

    Args:
        task: the task whose ``environment/`` to build.
        config: the sandbox config (its ``docker_host``).

    Raises:
        ConfigError: a base image is neither local nor pullable.
        EnvError: the build failed or ran past ``[environment] build_timeout_sec``.
        SandboxError: the Docker daemon cannot be reached.
    """
    import docker.errors

    tag = f"{IMAGE_REPO}:{_environment_key(task)[:20]}"
    with _lock:
        guard = _building.setdefault(tag, threading.Lock())
    client, _ = docker_client(config)
    with guard:  # one build per image at a time; a removed image is built again
        try:
            try:
                return _from_attrs(tag, client.images.get(tag).attrs)
            except docker.errors.ImageNotFound:
                return _build(client, task, tag)
        except (docker.errors.DockerException, OSError) as exc:
            if isinstance(exc, docker.errors.APIError) and exc.status_code is not None and exc.status_code < 500:
                raise EnvError(f"{task.path}: building its image failed: {exc}") from exc
            raise SandboxError(f"Docker daemon failed while building the image of {task.path}: {exc}") from exc


def _build(client: Any, task: HarborTask, tag: str) -> TaskImage:
    deadline = time.monotonic() + task.build_timeout_s
    base = _base_image(client, task, deadline)
    base_workdir = ((client.images.get(base).attrs.get("Config") or {}).get("WorkingDir") or "").rstrip("/")
    workdir = task.workdir or base_workdir or DEFAULT_WORKDIR
    recipe = _SEED_DOCKERFILE.format(base=base, workdir=workdir, tar=SEED_TAR)
    labels = {IMAGE_LABEL: "harbor", LABEL_WORKDIR: workdir, LABEL_SOURCE: str(task.path)[:200], LABEL_TASK: task.name}
    try:
        _stream_build(client, f"{task.path / DOCKERFILE} (working-directory layer)", deadline,
                      fileobj=io.BytesIO(recipe.encode()), tag=tag, labels=labels,
                      timeout=max(60, int(task.build_timeout_s)))
    except _BuildFailed as exc:
        raise EnvError(f"{task.path}: packing the image's working directory {workdir} failed (the image needs "
                       f"/bin/sh, mkdir and tar): {exc.error}\nlog tail:\n{exc.log}") from None
    return _from_attrs(tag, client.images.get(tag).attrs)


class HarborDockerBackend(DockerBackend):
    """relax-agent's Docker backend with a tmpfs at ``/tests`` and at ``/logs`` (the verifier's files).

    Args:
        config: the sandbox config of the task (its image, working directory, limits).
        task_name: labels the container (``relax-agent.harbor.task``).
        tests_mb / logs_mb: sizes of the two extra tmpfs mounts.
    """

    def __init__(self, config: SandboxConfig, task_name: str, tests_mb: int = 16, logs_mb: int = 16) -> None:
        super().__init__(config)
        self.task_name, self.tests_mb, self.logs_mb = task_name, tests_mb, logs_mb

    def container_kwargs(self, name: str, now: float) -> dict[str, Any]:
        """:meth:`DockerBackend.container_kwargs` plus the ``/tests`` and ``/logs`` tmpfs mounts and the task label."""
        kwargs = super().container_kwargs(name, now)
        uid, gid = self.config.uid_gid
        kwargs["tmpfs"] = {**kwargs["tmpfs"],
                           "/tests": f"size={self.tests_mb}m,uid={uid},gid={gid},mode=0755",
                           "/logs": f"size={self.logs_mb}m,uid={uid},gid={gid},mode=0755"}
        kwargs["labels"] = {**kwargs["labels"], LABEL_TASK: self.task_name[:200]}
        return kwargs


async def unpack_workdir(sandbox: Sandbox, workdir: str) -> None:
    """Unpack the image's working directory (:data:`SEED_TAR`) into the container's tmpfs ``workdir``.

    Raises:
        SandboxError: the archive could not be unpacked (e.g. larger than ``sandbox.workdir_mb``).
    """
    res = await sandbox.exec(["tar", "-xf", SEED_TAR, "-C", workdir, "--no-same-owner"], timeout_s=120.0, cwd="/")
    if not res.ok:
        raise SandboxError(f"unpacking the image's {workdir} into the sandbox failed (exit {res.exit_code}; a tmpfs of "
                           f"sandbox.workdir_mb={sandbox.config.workdir_mb} MB): {res.stderr.strip()[-500:]}")


__all__ = ["DEFAULT_WORKDIR", "HarborDockerBackend", "IMAGE_REPO", "SEED_TAR", "TaskImage", "build_image",
           "unpack_workdir"]
