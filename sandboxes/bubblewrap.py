"""Bubblewrap sandboxes: no daemon, user namespaces, no network — for light tools.

Each command runs in a fresh ``bwrap`` with every namespace unshared (user, pid, net, ipc,
uts, cgroup), nested user namespaces disabled, a read-only root, the host's ``/usr`` (and the ``/bin``, ``/lib*``,
``/sbin`` links or dirs) bound read-only, no ``/etc`` beyond what is listed in
:data:`ETC_FILES`, a private ``/proc``, ``/dev`` and ``/tmp`` (tmpfs of ``tmp_mb``, per
command), and the sandbox's host directory bound read-write at ``workdir``. The command is
pid 2 of its own pid namespace, so every process it started dies when it ends or is killed.
When the trainer runs as root, ``bwrap`` itself is started as ``config.user`` (``setpriv``),
so the sandbox has no more rights on the host than ``nobody``. The host-side processes
(``setpriv``, ``bwrap``) are found on a fixed PATH and run with the fixed :data:`HOST_ENV`; the
exec's environment is handed to bwrap as ``--clearenv`` plus ``--setenv`` options read from a
memfd (``--args``), so a caller's ``PATH`` or ``LD_*`` only ever reaches the jail. Work dirs are
named after their owner process; :func:`reap_work_dirs` (run when a backend is built, unless
``reap_on_start`` is false) removes those of owners that died without cleaning up (SIGKILL).

Limits are rlimits set with ``prlimit`` inside the jail: address space ``memory_mb`` per process,
``nofile``, processes ``pids_limit`` (counted in the sandbox's own user namespace on
Linux >= 5.14, so sandboxes and other processes of the same uid do not share it), largest file
``workdir_mb``. There is no cgroup here, so total memory and total disk use of the work
directory are *not* bounded and ``oom_killed`` is never set; use Docker for heavy or
hostile workloads.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid

from relax_agent.errors import SandboxError
from relax_agent.sandboxes import reaper
from relax_agent.sandboxes._process import run_process, wipe_dir
from relax_agent.sandboxes.base import CD_OR_FAIL, EXEC_MARKER_ENV, BaseSandbox, RawResult, check_launch, launch_tag
from relax_agent.sandboxes.config import SandboxConfig
from relax_agent.sandboxes.local_unsafe import HOST_PATH, prlimit_prefix

WORK_DIR_PREFIX = "relax-bwrap-"
"""Host work dirs are ``<tmp>/relax-bwrap-<owner pid>-<owner start ticks>-n<owner pid namespace>-<random>``."""
HOST_ENV = {"PATH": HOST_PATH, "LANG": "C.UTF-8"}
"""The whole environment of the host-side processes (setpriv, bwrap): the caller's never reaches them."""
_OWNED_DIR = re.compile(re.escape(WORK_DIR_PREFIX) + r"(\d+)-(\d+)-(?:n(\d+)-)?")


def reap_work_dirs(tmp_dir: str | None = None, dry_run: bool = False) -> list[str]:
    """Remove the host work dirs of bubblewrap sandboxes whose owner process has died (SIGKILL
    leaves them); returns the paths removed (``dry_run``: that would be, and removes nothing).
    Dirs of live processes are kept, and so are those of processes in another pid namespace (their pid
    means another process here). Run when a backend is built and by ``relax-agent sandbox reap``."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    namespace = reaper.pid_namespace()
    removed = []
    with os.scandir(tmp_dir) as entries:
        for entry in entries:
            m = _OWNED_DIR.match(entry.name)
            if m is None or not entry.is_dir(follow_symlinks=False):
                continue
            if m.group(3) not in (None, "0", namespace):  # its owner's pid is not ours to look up
                continue
            ticks = reaper.start_ticks(int(m.group(1)))
            if ticks is None or (m.group(2) != "0" and ticks != m.group(2)):  # dead, or its pid was reused
                if not dry_run:
                    shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
"""Host files under /etc bound read-only into the sandbox (dynamic linker cache, time zone)."""
_ROOT_LINKS = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")


def _root_args() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in _ROOT_LINKS:
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    return args


class BubblewrapBackend:
    """Creates :class:`BubblewrapSandbox` objects."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.bwrap = shutil.which("bwrap", path=HOST_PATH)
        if self.bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed; run scripts/setup_docker.sh or apt-get install bubblewrap")
        self.setpriv = shutil.which("setpriv", path=HOST_PATH)
        if os.geteuid() == 0 and self.setpriv is None:
            raise SandboxError("setpriv (util-linux) is needed to drop root before starting bwrap; apt-get install util-linux")
        if config.reap_on_start:
            reap_work_dirs()

    async def create(self) -> BubblewrapSandbox:
        """A new sandbox (a host work directory; no process runs between commands)."""
        return BubblewrapSandbox(self.config, self.bwrap or "bwrap", self.setpriv or "setpriv")


class BubblewrapSandbox(BaseSandbox):
    """A host directory mounted at ``workdir``; each command gets a fresh bubblewrap jail."""

    def __init__(self, config: SandboxConfig, bwrap: str, setpriv: str = "/usr/bin/setpriv"):
        pid = os.getpid()
        self.host_dir = tempfile.mkdtemp(
            prefix=f"{WORK_DIR_PREFIX}{pid}-{reaper.start_ticks(pid) or 0}-n{reaper.pid_namespace()}-")
        super().__init__(config, f"bwrap-{uuid.uuid4().hex[:12]}", config.workdir)
        self._bwrap = bwrap
        self._setpriv = setpriv
        uid, gid = config.uid_gid
        self._as_root = os.geteuid() == 0
        if self._as_root:
            os.chown(self.host_dir, uid, gid)
        reaper.register_cleanup(f"bwrap:{self.id}", self._remove_dir)
        reaper.install_sigterm_handler()

    def _remove_dir(self) -> None:
        shutil.rmtree(self.host_dir, ignore_errors=True)

    def command(self, argv: list[str], cwd: str, env_fd: int | None = None, tag: str = "") -> list[str]:
        """The full host command line running ``argv`` in the jail, starting in ``cwd``.

        ``env_fd`` is a file of NUL-separated ``--setenv NAME VALUE`` options for bwrap (so the
        jail's environment never becomes the host-side processes' own, nor shows in ``ps``); the
        jail's launcher reports a missing ``cwd`` with ``tag`` (see :func:`.base.check_launch`).
        """
        cfg = self.config
        uid, gid = cfg.uid_gid
        drop = ([self._setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
                if self._as_root else [])
        jail = [
            self._bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            *_root_args(), "--proc", "/proc", "--dev", "/dev",
            "--size", str(cfg.tmp_mb * 2**20), "--tmpfs", "/tmp",
            "--bind", self.host_dir, self.workdir, "--remount-ro", "/", "--chdir", self.workdir,
            "--uid", str(uid), "--gid", str(gid), "--hostname", "sandbox", "--clearenv",
            *(["--args", str(env_fd)] if env_fd is not None else []), "--",
        ]
        launch = ["/bin/sh", "-c", CD_OR_FAIL + '\nshift 2\nexec "$@"', "relax-exec", cwd, tag]
        # rlimits are set inside the jail: RLIMIT_NPROC then counts this sandbox's user namespace
        # only, not every process of the uid on the host (Linux >= 5.14 ucounts)
        return [*drop, *jail, *prlimit_prefix(cfg, nproc=True), *launch, *argv]

    async def _run(self, argv: list[str], *, timeout_s: float, stdin: bytes | None, env: dict[str, str],
                   cwd: str, max_output_bytes: int) -> RawResult:
        env = {**env, EXEC_MARKER_ENV: uuid.uuid4().hex}
        tag = launch_tag()
        env_fd = os.memfd_create("relax-bwrap-env", os.MFD_CLOEXEC)
        try:
            os.write(env_fd, b"".join(b"--setenv\0%s\0%s\0" % (k.encode(), v.encode()) for k, v in env.items()))
            os.lseek(env_fd, 0, os.SEEK_SET)
            raw = await self._closable(argv, run_process(
                self.command(argv, cwd, env_fd, tag), timeout_s=timeout_s, stdin=stdin, env=dict(HOST_ENV), cwd="/",
                max_output_bytes=max_output_bytes, max_drain_bytes=self.config.max_drain_bytes,
                kill_grace_s=self.config.kill_grace_s, pass_fds=(env_fd,)))
        finally:
            os.close(env_fd)
        return check_launch(raw, tag, cwd, self.id)

    async def reset(self) -> None:
        """Empty the work directory (processes never outlive their command here)."""
        self._check_usable()
        wipe_dir(self.host_dir)

    async def _close(self) -> None:
        self._stop_running()
        reaper.unregister_cleanup(f"bwrap:{self.id}")
        self._remove_dir()
