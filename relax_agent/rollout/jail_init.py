"""The first process of an agent's jail (pid 1 of its namespaces); standard library only.

Run by :mod:`relax_agent.rollout.agent_jail` as ``python -I jail_init.py ARGS -- COMMAND`` inside
fresh pid, mount and network namespaces, as root. In order it:

1. joins the episode's cgroups (``--cgroup-procs``: each a ``cgroup.procs`` file), so that every
   process of the jail counts against the episode's memory and process limits;
2. gives it a ``/tmp`` of its own: a fresh tmpfs holding only the paths named by ``--expose``
   (its ``TMPDIR``, the directories of its program and working directory when they are under
   ``/tmp``), bind-mounted at the same paths (directories on the way mode 0711: enter, not list);
   and fresh tmpfs on ``/dev/shm``, ``/var/tmp`` and ``/run/lock``: other episodes' files, the run's
   (Ray's session directories, sockets) and whatever others left there are out of sight;
3. brings up the loopback of the new network namespace (nothing else is in it) and, with
   ``--socket PATH --port P``, listens on ``127.0.0.1:P`` and forwards each connection to the Unix
   socket ``PATH`` (the episode endpoint): the only service the agent can reach;
4. starts ``COMMAND`` as ``--uid`` (its group the same number, no supplementary groups, no
   capabilities, no new privileges: ``setpriv``; umask 077, so what it writes is its own);
5. drops to ``nobody``, forwards connections and reaps orphans until ``COMMAND`` exits, then exits
   with its status (128 + the signal when killed). The kernel then kills every process left in the
   pid namespace.

Errors: any setup step that fails exits 125 with the reason on stderr (the agent never starts).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys

_NOBODY = 65534
_SHM = "/dev/shm"
_SIOCSIFFLAGS = 0x8914
_IFF_UP_LOOPBACK_RUNNING = 0x1 | 0x8 | 0x40
_SETUP_FAILED = 125
_CHUNK_BYTES = 65536


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jail_init")
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--socket", default=None)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--cgroup-procs", action="append", default=[])
    parser.add_argument("--expose", action="append", default=[])
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        parser.error("no command after --")
    return args


def _mount(*args: str) -> None:
    """Run ``mount ARGS``. Raises: OSError naming the call and mount's message when it fails."""
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"mount {' '.join(args)}: {done.stderr.strip()}")


def _mount_private(exposed: list[str]) -> None:
    """Fresh tmpfs on /dev/shm, /var/tmp, /run/lock; a fresh /tmp holding only ``exposed`` (paths
    under /tmp), built on a staging tmpfs in the new /dev/shm and moved onto /tmp."""
    for target in (_SHM, "/var/tmp", "/run/lock"):
        if os.path.isdir(target) and not os.path.islink(target):
            _mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", target)
    tmp = os.path.realpath("/tmp")
    stage = os.path.join(_SHM, ".relax-tmp")
    os.mkdir(stage)
    _mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", stage)
    for path in exposed:
        rel = os.path.relpath(os.path.realpath(path), tmp)
        if rel == "." or rel.startswith(".."):
            continue  # /tmp itself is never shown; outside /tmp: visible as it is
        target = os.path.join(stage, rel)
        _make_path(stage, os.path.dirname(rel))
        os.mkdir(target)
        _mount("--bind", path, target)
    _mount("--move", stage, tmp)
    os.rmdir(stage)


def _make_path(root: str, rel: str) -> None:
    """Create the directories of ``rel`` under ``root``, mode 0711 (others may enter, not list)."""
    path = root
    for part in [p for p in rel.split(os.sep) if p]:
        path = os.path.join(path, part)
        if not os.path.isdir(path):
            os.mkdir(path)
            os.chmod(path, 0o711)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", _IFF_UP_LOOPBACK_RUNNING))


def _start_agent(uid: int, command: list[str], cwd: str) -> int:
    """Fork; the child becomes ``command`` as ``uid`` in ``cwd`` (resolved in the jail's view). The
    child's pid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(cwd)
            os.umask(0o077)
            os.execvp("setpriv", ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                                  "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--", *command])
        finally:
            os._exit(127)
    return pid


def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(_NOBODY)
    os.setuid(_NOBODY)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK_BYTES):
            writer.write(chunk)
            await writer.drain()
    except OSError:
        pass


async def _forward(socket_name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy both ways between the agent's connection and a new one to the endpoint until either side
    ends, then close both (an agent that hangs up is seen by the endpoint at once)."""
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(socket_name)
    except OSError:
        writer.close()
        return
    pipes = [asyncio.ensure_future(_pipe(reader, up_writer)), asyncio.ensure_future(_pipe(up_reader, writer))]
    await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
    for pipe in pipes:
        pipe.cancel()
    up_writer.close()
    writer.close()


async def _serve(listener: socket.socket | None, socket_name: str, agent_pid: int) -> int:
    """Forward until the agent exits (reaping every child meanwhile); the agent's exit code."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == agent_pid and not done.done():
                done.set_result(os.waitstatus_to_exitcode(status))

    loop.add_signal_handler(signal.SIGCHLD, reap)
    reap()  # the agent may have exited before the handler was set
    if listener is not None:
        await asyncio.start_server(lambda r, w: _forward(socket_name, r, w), sock=listener)
    code = await done
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    """Set up the jail, run the agent, return its exit code (see the module doc)."""
    args = _args(argv)
    try:
        for procs in args.cgroup_procs:
            with open(procs, "w") as f:
                f.write("0")
        listener, cwd = None, os.getcwd()
        if args.socket is not None:
            os.chdir(os.path.dirname(args.socket))  # reached through the cwd once /tmp is replaced
        _mount_private(args.expose)
        _loopback_up()
        if args.socket is not None:
            listener = socket.create_server(("127.0.0.1", args.port))
    except OSError as exc:
        print(f"relax-agent jail: setup failed: {exc}", file=sys.stderr)
        return _SETUP_FAILED
    agent_pid = _start_agent(args.uid, args.command, cwd)
    _drop_to_nobody()
    return asyncio.run(_serve(listener, os.path.basename(args.socket or ""), agent_pid))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
