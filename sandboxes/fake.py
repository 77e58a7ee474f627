"""An in-memory sandbox for tests: a tiny shell, a dict file system, and a safe arithmetic "python".

Nothing runs on the host. It implements the whole contract (it passes
:mod:`relax_agent.sandboxes.testing`) for the commands that suite uses:

* shell: ``;``, ``&&``, ``||``, ``&`` (background), redirections ``>``, ``>>``, ``<``, ``>&2``,
  ``2>&1`` and the programs ``echo``, ``printf`` (``%s`` only), ``cat``, ``pwd``, ``printenv``,
  ``true``, ``false``, ``exit``, ``sleep``, ``head -c N FILE``, ``ls``, ``mkdir -p``, ``sh -c``;
* ``python3 -c CODE`` where CODE holds assignments and ``print(...)`` of arithmetic over
  literals, names, comprehensions and a few builtins (``sum``, ``range``, ``min`` ...).

Files live only under ``workdir`` and ``/tmp``; anything else is a read-only file system.
Test hooks: :attr:`FakeBackend.created` lists every sandbox made, ``create_delay_s`` /
``fail_creates`` simulate slow or failing starts, :attr:`FakeSandbox.healthy` fails health checks.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
import posixpath
import shlex
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax_agent.errors import SandboxError
from relax_agent.sandboxes.base import BaseSandbox, RawResult
from relax_agent.sandboxes.config import SandboxConfig
from relax_agent.sandboxes.limits import OutputCap

_NOT_FOUND = 127


class _Exit(Exception):
    def __init__(self, code: int):
        self.code = code


class _Killed(Exception):
    """Output went past ``max_drain_bytes``: the fake kills the command like the real backends."""


@dataclass
class _Io:
    out: OutputCap
    err: OutputCap
    stdin: bytes = b""
    drain: int = 0
    redirect_out: str | None = None
    redirect_append: bool = False
    out_to_err: bool = False
    err_to_out: bool = False
    captured: bytearray = field(default_factory=bytearray)

    def write(self, data: bytes, err: bool = False) -> None:
        if err and self.err_to_out:
            err = False
        elif not err and self.out_to_err:
            err = True
        if not err and self.redirect_out is not None:
            self.captured += data
            return
        cap = self.err if err else self.out
        cap.feed(data)
        if cap.dropped > self.drain:
            raise _Killed


class FakeBackend:
    """Makes :class:`FakeSandbox` objects; records them in :attr:`created`."""

    def __init__(self, config: SandboxConfig | None = None, *, create_delay_s: float = 0.0, fail_creates: int = 0):
        self.config = config or SandboxConfig(backend="fake")
        self.create_delay_s = create_delay_s
        self.fail_creates = fail_creates
        self.created: list[FakeSandbox] = []

    async def create(self) -> FakeSandbox:
        """A new fake sandbox (after ``create_delay_s``; the first ``fail_creates`` calls raise).

        Raises:
            SandboxError: a simulated creation failure.
        """
        if self.create_delay_s:
            await asyncio.sleep(self.create_delay_s)
        if self.fail_creates > 0:
            self.fail_creates -= 1
            raise SandboxError("fake sandbox creation failed (FakeBackend.fail_creates)")
        sb = FakeSandbox(self.config)
        self.created.append(sb)
        return sb


class FakeSandbox(BaseSandbox):
    """In-memory sandbox; see the module docstring for what it understands."""

    def __init__(self, config: SandboxConfig | None = None):
        config = config or SandboxConfig(backend="fake")
        super().__init__(config, f"fake-{uuid.uuid4().hex[:12]}", config.workdir)
        self.files: dict[str, bytes] = {}
        self.healthy = True
        self.exec_count = 0
        self.reset_count = 0
        self._background: set[asyncio.Task[Any]] = set()

    # -- file system ---------------------------------------------------------------------
    def _path(self, path: str, cwd: str) -> str:
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(cwd, path))

    def _writable(self, path: str) -> bool:
        return any(path.startswith(root.rstrip("/") + "/") for root in (self.workdir, "/tmp"))

    def _write(self, path: str, data: bytes, append: bool = False) -> None:
        if not self._writable(path):
            raise OSError(f"cannot create {path}: Read-only file system")
        self.files[path] = (self.files.get(path, b"") if append else b"") + data

    def _read(self, path: str) -> bytes:
        if path == "/dev/null":
            return b""
        if path not in self.files:
            raise OSError(f"{path}: No such file or directory")
        return self.files[path]

    # -- programs ----------------------------------------------------------------------------
    async def _program(self, argv: list[str], io: _Io, env: dict[str, str], cwd: str) -> int:
        name, args = posixpath.basename(argv[0]), argv[1:]
        if name == "echo":
            io.write((" ".join(args) + "\n").encode())
        elif name == "printf":
            fmt, values = (args[0] if args else ""), args[1:]
            pieces = [fmt.replace("%s", v, 1) if "%s" in fmt else fmt for v in (values or [""])]
            io.write("".join(pieces).encode().decode("unicode_escape").encode())
        elif name == "cat":
            for path in args or ["-"]:
                if path != "--":
                    io.write(io.stdin if path == "-" else self._read(self._path(path, cwd)))
        elif name == "pwd":
            io.write(f"{cwd}\n".encode())
        elif name == "printenv":
            if not args:
                io.write("".join(f"{k}={v}\n" for k, v in env.items()).encode())
            elif args[0] not in env:
                return 1
            else:
                io.write(f"{env[args[0]]}\n".encode())
        elif name == "rm":
            for path in (a for a in args if not a.startswith("-")):
                self.files.pop(self._path(path, cwd), None)
        elif name in ("true", "false"):
            return int(name == "false")
        elif name == "exit":
            raise _Exit(int(args[0]) if args else 0)
        elif name == "sleep":
            await asyncio.sleep(float(args[0]))
        elif name == "head" and args[:1] == ["-c"] and len(args) == 3:
            await self._head(int(args[1]), self._path(args[2], cwd), io)
        elif name == "ls":
            prefix = self._path(args[0] if args else ".", cwd).rstrip("/") + "/"
            names = sorted({p[len(prefix):].split("/")[0] for p in self.files if p.startswith(prefix)})
            io.write("".join(f"{n}\n" for n in names).encode())
        elif name == "mkdir":
            if not all(self._writable(self._path(a, cwd) + "/") for a in args if a != "-p"):
                raise OSError("mkdir: Read-only file system")
        elif name in ("sh", "bash") and args[:1] == ["-c"] and len(args) >= 2:
            return await self._script(args[1], io, env, cwd)
        elif name.startswith("python") and args[:1] == ["-c"] and len(args) >= 2:
            return _fake_python(args[1], io)
        else:
            io.write(f"{name}: not found (FakeSandbox)\n".encode(), err=True)
            return _NOT_FOUND
        return 0

    async def _head(self, n: int, path: str, io: _Io) -> None:
        if path != "/dev/zero":
            io.write(self._read(path)[:n])
            return
        while n > 0:
            chunk = min(n, 1 << 16)
            io.write(b"\0" * chunk)
            n -= chunk
            await asyncio.sleep(0)

    # -- a tiny shell --------------------------------------------------------------------
    async def _simple(self, words: list[str], io: _Io, env: dict[str, str], cwd: str) -> int:
        argv: list[str] = []
        sub = _Io(io.out, io.err, io.stdin, io.drain, out_to_err=io.out_to_err, err_to_out=io.err_to_out)
        it = iter(words)
        for w in it:
            if w in (">", ">>"):
                sub.redirect_out, sub.redirect_append = self._path(next(it, ""), cwd), w == ">>"
            elif w == "<":
                sub.stdin = self._read(self._path(next(it, ""), cwd))
            elif w == ">&":
                target = next(it, "")
                if argv and argv[-1] == "2" and target == "1":
                    argv.pop()
                    sub.err_to_out = True
                else:
                    sub.out_to_err = target == "2"
            else:
                argv.append(w)
        if not argv:
            return 0
        try:
            code = await self._program(argv, sub, env, cwd)
        except OSError as exc:
            sub.write(f"{argv[0]}: {exc}\n".encode(), err=True)
            code = 1
        if sub.redirect_out is not None:
            try:
                self._write(sub.redirect_out, bytes(sub.captured), sub.redirect_append)
            except OSError as exc:
                io.write(f"sh: {exc}\n".encode(), err=True)
                return 2
        return code

    async def _and_or(self, tokens: list[str], io: _Io, env: dict[str, str], cwd: str) -> int:
        code, op, words = 0, None, []
        for tok in [*tokens, "&&"]:
            if tok not in ("&&", "||"):
                words.append(tok)
                continue
            if op is None or (op == "&&") == (code == 0):
                code = await self._simple(words, io, env, cwd)
            op, words = tok, []
        return code

    async def _script(self, script: str, io: _Io, env: dict[str, str], cwd: str) -> int:
        lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        code, part = 0, []
        for tok in [*lexer, ";"]:
            if tok not in (";", "&"):
                part.append(tok)
                continue
            if tok == "&":
                task = asyncio.ensure_future(self._and_or(part, io, env, cwd))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            elif part:
                code = await self._and_or(part, io, env, cwd)
            part = []
        return code

    async def _main(self, argv: list[str], io: _Io, env: dict[str, str], cwd: str) -> int:
        started = set(self._background)
        try:
            code = await self._program(argv, io, env, cwd)
        except _Exit as exc:
            code = exc.code
        mine = self._background - started
        if mine:  # like a real pipe: the command ends when its background jobs let go of stdout
            await asyncio.gather(*mine, return_exceptions=True)
        return code

    def _is_dir(self, path: str) -> bool:
        path = path.rstrip("/") or "/"
        return (path in ("/", "/tmp", "/dev", self.workdir.rstrip("/") or "/")
                or any(f.startswith(path + "/") for f in self.files))

    async def _run(self, argv: list[str], *, timeout_s: float, stdin: bytes | None, env: dict[str, str],
                   cwd: str, max_output_bytes: int) -> RawResult:
        if not self._is_dir(posixpath.normpath(cwd)):
            raise SandboxError(f"cwd={cwd!r} does not exist or is not a directory in sandbox {self.id}")
        return await self._closable(argv, self._run_main(argv, timeout_s=timeout_s, stdin=stdin, env=env, cwd=cwd,
                                                         max_output_bytes=max_output_bytes))

    async def _run_main(self, argv: list[str], *, timeout_s: float, stdin: bytes | None, env: dict[str, str],
                        cwd: str, max_output_bytes: int) -> RawResult:
        self.exec_count += 1
        io = _Io(OutputCap(max_output_bytes), OutputCap(max_output_bytes), stdin or b"", self.config.max_drain_bytes)
        start = time.monotonic()
        before = set(self._background)
        timed_out = killed = False
        try:
            code = await asyncio.wait_for(self._main(argv, io, env, cwd), timeout_s)
        except asyncio.TimeoutError:
            code, timed_out = 137, True
        except _Killed:
            code, killed = 137, True
        except OSError as exc:
            io.err.feed(f"{exc}\n".encode())
            code = 1
        finally:
            for task in self._background - before:
                task.cancel()
        return RawResult(code, bytes(io.out.kept), bytes(io.err.kept), timed_out=timed_out,
                         truncated=killed or io.out.truncated or io.err.truncated,
                         duration_s=time.monotonic() - start)

    # -- the rest of the contract, directly on the dict ----------------------------------------
    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` to ``path`` in the in-memory file system, creating parent folders.

        Raises:
            SandboxError: the sandbox is closed or broken, or the file could not be written.
        """
        self._check_usable()
        try:
            self._write(self._path(path, self.workdir), data.encode() if isinstance(data, str) else bytes(data))
        except OSError as exc:
            raise SandboxError(f"write_file({path!r}) failed: {exc}") from exc

    async def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` in the in-memory file system.

        Raises:
            SandboxError: the file is missing, a directory or device, or over ``config.max_file_bytes``.
        """
        self._check_usable()
        target = self._path(self._resolve(path), self.workdir)
        if self._is_dir(target):
            raise SandboxError(f"read_file({path!r}) failed: {target}: is a directory, not a regular file")
        if target.startswith("/dev/"):
            raise SandboxError(f"read_file({path!r}) failed: {target}: not a regular file (device, FIFO or socket)")
        try:
            data = self._read(target)
        except OSError as exc:
            raise SandboxError(f"read_file({path!r}) failed: {exc}") from exc
        if len(data) > self.config.max_file_bytes:
            raise SandboxError(f"read_file({path!r}): file exceeds sandbox.max_file_bytes={self.config.max_file_bytes}")
        return data

    async def reset(self) -> None:
        """Cancel background jobs and forget every file."""
        self._check_usable()
        for task in list(self._background):
            task.cancel()
        self.files.clear()
        self.reset_count += 1

    async def health(self) -> bool:
        """False when the test marked the sandbox unhealthy, else :meth:`BaseSandbox.health`."""
        return self.healthy and await super().health()

    async def _close(self) -> None:
        for task in list(self._background):
            task.cancel()
        self._stop_running()
        self.files.clear()


# -- "python": assignments and print() of safe arithmetic ------------------------------------

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: pow}
_CMPOPS: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge}
_FUNCS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (abs, min, max, sum, range, len, round, int, float, str, sorted, list, pow)}
_FUNCS.update(gcd=math.gcd, factorial=math.factorial, isqrt=math.isqrt)


class _Unsupported(Exception):
    pass


def _eval(node: ast.AST, names: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, names), _eval(node.right, names)
        if isinstance(node.op, ast.Pow) and abs(right) > 10_000:
            raise _Unsupported("exponent too large for the fake")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, names)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
        return _CMPOPS[type(node.ops[0])](_eval(node.left, names), _eval(node.comparators[0], names))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*[_eval(a, names) for a in node.args])
    if isinstance(node, (ast.GeneratorExp, ast.ListComp)) and len(node.generators) == 1:
        gen = node.generators[0]
        if not isinstance(gen.target, ast.Name):
            raise _Unsupported("comprehension target")
        out = []
        for value in _eval(gen.iter, names):
            scope = {**names, gen.target.id: value}
            if all(_eval(cond, scope) for cond in gen.ifs):
                out.append(_eval(node.elt, scope))
        return out
    if isinstance(node, ast.List):
        return [_eval(e, names) for e in node.elts]
    raise _Unsupported(type(node).__name__)


def _fake_python(code: str, io: _Io) -> int:
    names: dict[str, Any] = {}
    try:
        for stmt in ast.parse(code).body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                names[stmt.targets[0].id] = _eval(stmt.value, names)
            elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                  and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "print"):
                io.write((" ".join(str(_eval(a, names)) for a in stmt.value.args) + "\n").encode())
            else:
                raise _Unsupported(type(stmt).__name__)
    except SyntaxError as exc:
        io.write(f"SyntaxError: {exc}\n".encode(), err=True)
        return 1
    except _Unsupported as exc:
        io.write(f"FakeSandbox cannot run this Python ({exc}); use a real backend\n".encode(), err=True)
        return 1
    except (ArithmeticError, TypeError, ValueError) as exc:
        io.write(f"Traceback (most recent call last):\n{type(exc).__name__}: {exc}\n".encode(), err=True)
        return 1
    return 0
