"""Every sandbox backend passes the same contract suite (relax_agent.sandboxes.testing)."""

from __future__ import annotations

import pytest

from relax_agent.sandboxes import FakeBackend, SandboxConfig
from relax_agent.sandboxes.testing import SandboxContract, require_backend

# workdir_mb leaves room for the 50 MB stdin / write_file check (Docker charges the tmpfs to memory_mb)
SMALL = dict(max_output_bytes=4096, memory_mb=256, pids_limit=64, workdir_mb=80, tmp_mb=16, kill_grace_s=1.0)


class TestFakeContract(SandboxContract):
    async def make_sandbox(self):
        return await FakeBackend(SandboxConfig(backend="fake", **SMALL)).create()


class TestSubprocessContract(SandboxContract):
    isolated = False  # the unsafe backend shares the host file system

    async def make_sandbox(self):
        with pytest.warns(RuntimeWarning, match="without isolation"):
            return await SandboxConfig(backend="subprocess", unsafe=True, **SMALL).build().create()


class TestBubblewrapContract(SandboxContract):
    async def make_sandbox(self):
        require_backend("bubblewrap")
        return await SandboxConfig(backend="bubblewrap", **SMALL).build().create()


@pytest.mark.docker
class TestDockerContract(SandboxContract):
    async def make_sandbox(self):
        require_backend("docker")
        return await SandboxConfig(backend="docker", ttl_s=300, **SMALL).build().create()
