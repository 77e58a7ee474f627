"""relax_agent.sandboxes: run untrusted, model-written code with limits on by default.

::

    from relax_agent.sandboxes import SandboxConfig, SandboxPool

    backend = SandboxConfig(backend="docker", memory_mb=256).build()
    async with await backend.create() as sb:
        result = await sb.run_python("print(6 * 7)", timeout_s=5)

Backends (one per module): ``docker`` (default), ``bubblewrap``, ``subprocess`` (unsafe,
opt-in), ``fake`` (tests). :mod:`.testing` is the contract suite any backend can run.
"""

from __future__ import annotations

from relax_agent.sandboxes.base import BaseSandbox, ExecResult, ReportsState, Sandbox, SandboxBackend
from relax_agent.sandboxes.config import PoolConfig, SandboxConfig
from relax_agent.sandboxes.fake import FakeBackend, FakeSandbox
from relax_agent.sandboxes.pool import PoolStats, SandboxPool, shared_pool
from relax_agent.sandboxes.portal import portal_loop, run_sync
from relax_agent.sandboxes.reaper import reap

__all__ = [
    "BaseSandbox",
    "ExecResult",
    "FakeBackend",
    "FakeSandbox",
    "PoolConfig",
    "PoolStats",
    "ReportsState",
    "Sandbox",
    "SandboxBackend",
    "SandboxConfig",
    "SandboxPool",
    "portal_loop",
    "reap",
    "run_sync",
    "shared_pool",
]
