"""The shell programs the Docker backend runs inside a container: the exec launcher, the process
scan that kills what an exec left behind, and the OOM probe. Builtins of a POSIX shell only, so
they work in any image with ``/bin/sh`` and ``timeout``, even when a fork bomb holds every pid."""

from __future__ import annotations

import math

from relax_agent.sandboxes.base import CD_OR_FAIL, EXEC_MARKER_ENV

OOM_PROBE = "cat /sys/fs/cgroup/memory.events 2>/dev/null || cat /sys/fs/cgroup/memory/memory.oom_control"
SCAN = r"""
has() {
  l=
  while IFS= read -r l || [ -n "$l" ]; do case $l in *"$2"*) return 0 ;; esac; l=; done 2>/dev/null <"$1"
  return 1
}
holds() {
  [ -n "$o" ] || return 1
  for k in 0 1 2 3 4 5 6 7 8 9; do
    [ "$1/fd/$k" -ef "$o" ] || [ "$1/fd/$k" -ef "$e" ] && return 0
  done 2>/dev/null
  return 1
}
prev= n=0
while [ "$n" -lt 20 ]; do
  pids=
  for d in /proc/[0-9]*; do
    q=${d#/proc/}
    if [ "$q" != "$$" ] && ! skip "$d" && { has "$d/environ" "$m" || holds "$d"; }; then pids="$pids $q"; fi
  done
  [ "$pids" = "$prev" ] && break
  kill -STOP $pids 2>/dev/null
  prev=$pids n=$((n + 1))
done
[ -n "$prev" ] && kill -KILL $prev 2>/dev/null
"""
"""Kill every process whose environment holds ``$m`` (``NAME=marker``) or that has one of the files
``$o`` / ``$e`` (the exec's output pipes; none when ``$o`` is empty) open as fd 0-9, except ``$$``
and those for which ``skip /proc/PID`` succeeds. Shell builtins only (``read`` skips the NULs
of ``environ``), so it still works when a fork bomb holds every pid of ``pids_limit``.
Processes are stopped first and the scan is repeated until it finds no new ones, so a fork bomb
cannot outrun it; then all of them are killed at once."""

KILL_MARKED = ('m="$1" t="$2" o= e=\nskip() { has "$1/cmdline" "$t"; }' + SCAN + "true\n")
"""Host-side helper exec (``$1`` ``NAME=marker``, ``$2`` launch tag): kill the exec's processes but
not its launcher, which then kills whatever else holds the exec's output and exits."""

LAUNCHER = CD_OR_FAIL + r"""
t=$3; shift 3
exec 3<&0
timeout -s KILL "$t" "$@" <&3 3<&- &
p=$!
exec 3<&- </dev/null 4>&2 2>/dev/null
wait "$p"; rc=$?
kill -KILL -"$p"
o=/proc/$$/fd/1 e=/proc/$$/fd/4
skip() { false; }
""" + f'm="{EXEC_MARKER_ENV}=${EXEC_MARKER_ENV}"' + SCAN + 'exit "$rc"\n'
"""Runs every exec: ``$1`` cwd, ``$2`` launch tag, ``$3`` timeout, then argv. The command runs under
``timeout -s KILL`` (in its own process group); when it ends, that group, every process carrying
the exec's marker and every process still holding the exec's stdout/stderr are killed, so nothing
it started (a detached fork bomb, a daemon that left the group) outlives it. The launcher's own
stderr goes to /dev/null once the command started (the shell would report "Killed" jobs there)."""


def timeout_arg(timeout_s: float) -> str:
    """``timeout_s`` for coreutils ``timeout``, rounded up to whole ms (``0.000`` would mean no limit)."""
    return f"{max(math.ceil(timeout_s * 1000), 1) / 1000:.3f}"
