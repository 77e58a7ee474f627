"""The ``subprocess`` backend: commands run directly on the host. NO ISOLATION — development only.

Refused unless the config says ``unsafe: true``. What it does provide: a private temporary
work directory (the sandbox's ``workdir`` is that host path), a scrubbed environment,
per-process rlimits through ``prlimit`` (address space ``memory_mb``, open files ``nofile``,
file size ``workdir_mb``), the timeout, output caps, and killing the command's whole process
group on timeout, overflow, cancellation or when it ends. There is no network, file-system,
pids or total-memory isolation: model-written code can read and write anything the trainer can.

(The module is not called ``subprocess.py`` so it can never shadow the standard library.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import warnings

from relax_agent.errors import SandboxError
from relax_agent.sandboxes import reaper
from relax_agent.sandboxes._process import run_process, wipe_dir
from relax_agent.sandboxes.base import EXEC_MARKER_ENV, BaseSandbox, RawResult
from relax_agent.sandboxes.config import SandboxConfig

HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
"""Where host-side helpers (prlimit, setpriv) are looked up: never a caller's PATH."""


def prlimit_prefix(config: SandboxConfig, *, nproc: bool) -> list[str]:
    """``prlimit`` arguments applying the config's per-process limits (empty if prlimit is missing)."""
    prlimit = shutil.which("prlimit", path=HOST_PATH)
    if prlimit is None:
        return []
    args = [prlimit, f"--as={config.memory_mb * 2**20}", f"--nofile={config.nofile}",
            f"--fsize={config.workdir_mb * 2**20}"]
    if nproc:
        args.append(f"--nproc={config.pids_limit}")
    return [*args, "--"]


class SubprocessBackend:
    """Creates :class:`SubprocessSandbox` objects (host processes in a temp dir)."""

    def __init__(self, config: SandboxConfig):
        if not config.unsafe:
            raise SandboxError("the subprocess sandbox backend needs sandbox.unsafe: true (it does not isolate)")
        self.config = config

    async def create(self) -> SubprocessSandbox:
        """A new sandbox with its own temporary work directory."""
        warnings.warn("sandbox backend 'subprocess' runs model-written code on the host without isolation",
                      RuntimeWarning, stacklevel=2)
        return SubprocessSandbox(self.config)


class SubprocessSandbox(BaseSandbox):
    """Commands run as host processes in a private temporary directory (no isolation)."""

    def __init__(self, config: SandboxConfig):
        host_dir = tempfile.mkdtemp(prefix="relax-sandbox-")
        super().__init__(config, f"local-{uuid.uuid4().hex[:12]}", host_dir)
        reaper.register_cleanup(f"local:{self.id}", self._remove_dir)
        reaper.install_sigterm_handler()

    def base_env(self) -> dict[str, str]:
        """The base environment with ``TMPDIR`` set to the work directory (temporary files stay in it)."""
        return {**super().base_env(), "TMPDIR": self.workdir}

    def _remove_dir(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    async def _run(self, argv: list[str], *, timeout_s: float, stdin: bytes | None, env: dict[str, str],
                   cwd: str, max_output_bytes: int) -> RawResult:
        env = {**env, EXEC_MARKER_ENV: uuid.uuid4().hex}
        if not os.path.isdir(cwd):
            raise SandboxError(f"cwd={cwd!r} does not exist or is not a directory in sandbox {self.id}")
        try:
            return await self._closable(argv, run_process(
                [*prlimit_prefix(self.config, nproc=False), *argv], timeout_s=timeout_s, stdin=stdin, env=env,
                cwd=cwd, max_output_bytes=max_output_bytes, max_drain_bytes=self.config.max_drain_bytes,
                kill_grace_s=self.config.kill_grace_s))
        except (FileNotFoundError, NotADirectoryError) as exc:
            return RawResult(127, b"", f"{exc}\n".encode())

    async def reset(self) -> None:
        """Empty the work directory (no process outlives its command in this backend)."""
        self._check_usable()
        wipe_dir(self.workdir)

    async def _close(self) -> None:
        self._stop_running()
        reaper.unregister_cleanup(f"local:{self.id}")
        self._remove_dir()
