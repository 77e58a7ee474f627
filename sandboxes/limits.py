"""Limits every backend applies the same way: output caps, the kernel's argument-size limits,
environment checks and the shell's exit code for a signal."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from relax_agent.errors import SandboxError


class OutputCap:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        """Append ``chunk``, keeping at most ``limit`` bytes in total."""
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    @property
    def truncated(self) -> bool:
        """True when bytes were dropped."""
        return self.dropped > 0


def signal_exit_code(returncode: int) -> int:
    """Map a Python ``returncode`` (negative N for signal N) to the shell's 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


MAX_ARG_BYTES = 128 * 1024 - 1
"""Longest single argument or ``NAME=value`` environment entry (UTF-8 bytes): Linux's
``MAX_ARG_STRLEN`` (32 pages, the NUL included) caps each one, on the host and in a container."""
MAX_EXEC_ARG_BYTES = 1024 * 1024
"""Most UTF-8 bytes of a command's arguments and environment together (each with its NUL). Below
Linux's ``ARG_MAX`` (a quarter of the 8 MiB default stack, 2 MiB) with room for the launchers'
own arguments, so a command every backend can start; larger data goes through ``stdin`` or
``write_file``."""


def check_arg_sizes(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse an argument list the kernel would refuse (``E2BIG``): the same :class:`SandboxError`
    on every backend, before anything runs (bubblewrap raised a raw ``OSError``, Docker returned
    exit 1 with "argument list too long").

    Raises:
        SandboxError: an argument or ``NAME=value`` entry over :data:`MAX_ARG_BYTES`, or all of them
            over :data:`MAX_EXEC_ARG_BYTES`; names the item, its size and the limit.
    """
    total = 0
    for i, arg in enumerate(argv):
        n = len(arg.encode(errors="surrogateescape"))
        if n > MAX_ARG_BYTES:
            raise SandboxError(f"argument {i} of cmd ({arg[:40]!r}...) is {n} bytes, over the {MAX_ARG_BYTES}-byte "
                               "limit of one argument (argument list too long); pass large data through stdin or "
                               "write_file")
        total += n + 1
    for key, value in env.items():
        n = len(key.encode(errors="surrogateescape")) + 1 + len(value.encode(errors="surrogateescape"))
        if n > MAX_ARG_BYTES:
            raise SandboxError(f"environment variable {key!r} is {n} bytes, over the {MAX_ARG_BYTES}-byte limit of "
                               "one entry (argument list too long); pass large data through stdin or write_file")
        total += n + 1
    if total > MAX_EXEC_ARG_BYTES:
        raise SandboxError(f"cmd's {len(argv)} arguments and {len(env)} environment variables are {total} bytes, over "
                           f"the {MAX_EXEC_ARG_BYTES}-byte limit (argument list too long); pass large data through "
                           "stdin or write_file")


def unencodable(text: str) -> str | None:
    """Why ``text`` cannot be passed to a process (a NUL byte, or a lone surrogate that has no UTF-8
    encoding), or None when it can."""
    if "\0" in text:
        return "a NUL byte"
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return f"a lone surrogate {text[exc.start]!r} at index {exc.start} (not valid UTF-8)"
    return None


def check_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as a plain dict, checked.

    Raises:
        SandboxError: a name is empty or holds ``=`` or NUL, or a value is not a str or holds NUL.
    """
    out = {}
    for key, value in env.items():
        if (not key or "=" in key or not isinstance(value, str) or unencodable(key) is not None
                or unencodable(value) is not None):
            raise SandboxError(f"bad environment variable {key!r}={value!r}: names need no '=', values must be str, "
                               "neither may hold a NUL byte or a lone surrogate")
        out[key] = value
    return out
