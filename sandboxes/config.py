"""The sandbox config (``env.sandbox`` / ``SandboxConfig``) and the pool config; ``build()`` picks
the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from relax_agent.configbase import Section

if TYPE_CHECKING:
    from relax_agent.sandboxes.base import SandboxBackend

BackendName = Literal["docker", "bubblewrap", "subprocess", "fake"]


class PoolConfig(Section):
    """A pool of pre-started sandboxes (see :class:`relax_agent.sandboxes.SandboxPool`)."""

    size: int = Field(default=0, ge=0)
    """Sandboxes kept started and idle, ready to hand out; 0 creates one per acquire."""
    max_size: int = Field(default=32, ge=1)
    """Most sandboxes alive at once (idle + in use); ``acquire`` waits beyond it."""
    acquire_timeout_s: float = Field(default=60.0, gt=0)
    """How long ``acquire`` waits for a free slot before raising SandboxTimeoutError."""
    on_release: Literal["reset", "replace"] = "reset"
    """"reset": kill processes and wipe the work dir, then reuse; "replace": close and start anew."""
    health_check_idle_s: float = Field(default=30.0, ge=0)
    """An idle sandbox older than this is health-checked before it is handed out."""
    max_uses: int = Field(default=256, ge=1)
    """Episodes one sandbox serves before it is replaced."""

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.size > self.max_size:
            raise ValueError(f"pool.size={self.size} exceeds pool.max_size={self.max_size}")
        return self


class SandboxConfig(Section):
    """Which sandbox backend to use and its limits (all limits apply per sandbox)."""

    backend: BackendName = "docker"
    """"docker" (default, strongest), "bubblewrap" (no daemon, light tools), "subprocess"
    (no isolation; development only, needs ``unsafe: true``), "fake" (in-memory, tests)."""
    unsafe: bool = False
    """Must be true to use the "subprocess" backend, which does not isolate anything."""
    image: str = "relax-agent/python:bookworm"
    """Docker image; build it offline with ``relax-agent sandbox build-image``."""
    memory_mb: int = Field(default=512, ge=16)
    """Memory limit (Docker: RAM == RAM + swap; bubblewrap/subprocess: address space per process)."""
    cpus: float = Field(default=1.0, gt=0)
    """CPU quota in cores (Docker only)."""
    pids_limit: int = Field(default=128, ge=8)
    """Most processes/threads at once (Docker: cgroup; bubblewrap/subprocess: RLIMIT_NPROC)."""
    nofile: int = Field(default=256, ge=16)
    """Most open file descriptors per process."""
    workdir: str = "/work"
    """Work directory inside the sandbox (a tmpfs in Docker); relative paths resolve here."""
    workdir_mb: int = Field(default=128, ge=1)
    """Size of the work directory (Docker tmpfs; bubblewrap/subprocess: largest file)."""
    tmp_mb: int = Field(default=32, ge=1)
    """Size of the /tmp tmpfs (Docker and bubblewrap)."""
    max_output_bytes: int = Field(default=65536, ge=1)
    """Bytes of stdout and of stderr kept per command; the rest is dropped (``truncated``)."""
    max_drain_bytes: int = Field(default=16 * 2**20, ge=1)
    """Output read past ``max_output_bytes`` before the command is killed to spare the host."""
    max_file_bytes: int = Field(default=16 * 2**20, ge=1)
    """Largest file ``read_file`` returns."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Default per-command timeout."""
    max_timeout_s: float = Field(default=600.0, gt=0)
    """Largest ``timeout_s`` a caller may ask for."""
    kill_grace_s: float = Field(default=2.0, gt=0)
    """After ``timeout_s``, how long the host waits for the in-sandbox kill before killing harder."""
    ttl_s: float = Field(default=3600.0, gt=0)
    """Longest life of a sandbox: a Docker container exits (and is removed) after this even if
    the trainer was SIGKILLed, and the reaper removes it once this has passed."""
    user: str = "65534:65534"
    """Numeric ``uid:gid`` that commands run as (65534 is ``nobody``)."""
    python: str = "python3"
    """Python interpreter inside the sandbox, used by ``run_python``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for every command (the host environment never leaks in)."""
    run_id: str | None = None
    """Label for this run's containers; defaults to ``<host>-<pid>``."""
    docker_host: str | None = None
    """Docker daemon URL; None uses DOCKER_HOST or the local socket."""
    max_workers: int = Field(default=64, ge=1)
    """Threads (and Docker connections) for blocking Docker calls; bounds concurrent execs."""
    reap_on_start: bool = True
    """Remove containers of dead runs when the first Docker sandbox of this process starts."""
    pool: PoolConfig = Field(default_factory=PoolConfig)

    @model_validator(mode="after")
    def _check(self) -> SandboxConfig:
        if self.backend == "subprocess" and not self.unsafe:
            raise ValueError(
                "sandbox backend 'subprocess' runs commands on the host without isolation; "
                "set sandbox.unsafe: true to allow it (development only)"
            )
        uid, sep, gid = self.user.partition(":")
        if not (uid.isdigit() and gid.isdigit() and sep):
            raise ValueError(f"sandbox.user={self.user!r} must be numeric 'uid:gid', e.g. '65534:65534'")
        if not self.workdir.startswith("/"):
            raise ValueError(f"sandbox.workdir={self.workdir!r} must be an absolute path")
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(f"sandbox.timeout_s={self.timeout_s} exceeds sandbox.max_timeout_s={self.max_timeout_s}")
        return self

    @property
    def uid_gid(self) -> tuple[int, int]:
        """``user`` as two ints."""
        uid, _, gid = self.user.partition(":")
        return int(uid), int(gid)

    def build(self) -> SandboxBackend:
        """The backend that creates sandboxes with this config (imports its dependencies lazily)."""
        if self.backend == "docker":
            from relax_agent.sandboxes.docker import DockerBackend

            return DockerBackend(self)
        if self.backend == "bubblewrap":
            from relax_agent.sandboxes.bubblewrap import BubblewrapBackend

            return BubblewrapBackend(self)
        if self.backend == "subprocess":
            from relax_agent.sandboxes.local_unsafe import SubprocessBackend

            return SubprocessBackend(self)
        from relax_agent.sandboxes.fake import FakeBackend

        return FakeBackend(self)
