"""A Ray cluster of several hosts on one machine, built from Linux network namespaces.

Each host is a network namespace with one address on a private subnet (default 10.77.0.0/24);
the hosts meet on a bridge that lives in a namespace of its own (the "switch"), so nothing in the
machine's own network namespace is touched: no address, route, bridge or firewall rule::

    <prefix>sw   bridge <prefix>br, one veth end per host
    <prefix>1    10.77.0.1   ray start --head          (resources {"head_host": 1})
    <prefix>2    10.77.0.2   ray start --address=...   (resources {"rollout_host": 4})
    <prefix>3    10.77.0.3   ray start --address=...   (resources {"rollout_host": 4})

Every Ray node runs with ``RAY_AUTH_MODE=token`` and the cluster's token, so a process that reaches
the head's port without it cannot join. :meth:`NetnsCluster.down` kills every process of every
namespace it made (``ip netns pids``, SIGKILL) and deletes the namespaces (which removes their
veths and the bridge); it runs also when :meth:`up` fails half way.

Needs root and ``ip`` (iproute2). :func:`unavailable` says why the machine cannot run it (a
test skips with that reason).

Users run it as a script::

    sudo python -m tests.e2e.netns_cluster up      # prints the head address and the token
    sudo ip netns exec rxn1 env RAY_AUTH_MODE=token RAY_AUTH_TOKEN=... relax-agent train ... \\
        data.ray_address=10.77.0.1:6379
    sudo python -m tests.e2e.netns_cluster down
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
IP = shutil.which("ip") or "/usr/sbin/ip"
RAY_PORT = 6379
STATE_FILE = "cluster.json"


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can): not root, no ``ip``, or the
    kernel refused a test namespace (its message)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if not os.path.exists(IP):
        return f"no `ip` command (iproute2) at {IP}"
    name = f"rxnprobe{os.getpid()}"
    probe = subprocess.run([IP, "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the kernel refused a network namespace: `ip netns add` said {probe.stderr.strip()!r}"
    subprocess.run([IP, "netns", "del", name], capture_output=True)
    return None


def _ray_bin() -> str:
    found = Path(sys.executable).with_name("ray")
    return str(found) if found.exists() else (shutil.which("ray") or "ray")


@dataclass
class NetnsCluster:
    """``hosts`` namespaces on ``subnet``.0/24: host 1 the Ray head, the others Ray workers.

    Args:
        prefix: namespace and link name prefix (short: link names have at most 15 characters).
        subnet: the first three octets of the /24 (host ``i`` gets ``subnet.i``).
        hosts: Ray hosts (1 head + ``hosts - 1`` workers).
        num_cpus: CPUs each Ray node offers.
        object_store_bytes: object store of each Ray node, bytes.
        worker_resources: custom Ray resources of each worker host (placement by node).
        head_resources: custom Ray resources of the head.
        env: extra environment of every Ray node (e.g. ``PYTHONPATH`` so workers import the project).
        ray_system_config: Ray system config of the head (beside ``worker_niceness: 0``), e.g. faster
            node-death detection (``health_check_period_ms``, ``health_check_failure_threshold``).
    """

    prefix: str = "rxn"
    subnet: str = "10.77.0"
    hosts: int = 3
    num_cpus: int = 1
    object_store_bytes: int = 200_000_000
    worker_resources: Mapping[str, float] = field(default_factory=lambda: {"rollout_host": 4})
    head_resources: Mapping[str, float] = field(default_factory=lambda: {"head_host": 1})
    env: Mapping[str, str] = field(default_factory=dict)
    ray_system_config: Mapping[str, Any] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    temp_dir: str = ""
    made: list[str] = field(default_factory=list)
    """Namespaces made so far (what :meth:`down` removes)."""

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def ns(self, i: int) -> str:
        """Namespace of host ``i`` (1-based; ``hosts + 1`` and up: strangers, not in Ray)."""
        return f"{self.prefix}{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i}"

    @property
    def head_address(self) -> str:
        return f"{self.ip(1)}:{RAY_PORT}"

    def ray_env(self) -> dict[str, str]:
        """Environment of a process that joins the cluster (token auth on, the cluster's token)."""
        return {**os.environ, **self.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                "RAY_USAGE_STATS_ENABLED": "0"}

    # -- network ----------------------------------------------------------------------------------
    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = [IP, *args] if ns is None else [IP, "netns", "exec", ns, IP, *args]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")

    def _add_ns(self, name: str) -> None:
        self._ip("netns", "add", name)
        self.made.append(name)
        self._ip("link", "set", "lo", "up", ns=name)

    def add_host(self, i: int) -> str:
        """Make namespace ``i`` with address ``subnet.i`` on the bridge; returns the namespace."""
        name, a, b = self.ns(i), f"{self.prefix}{i}a", f"{self.prefix}{i}b"
        self._add_ns(name)
        self._ip("link", "add", a, "type", "veth", "peer", "name", b)
        self._ip("link", "set", a, "netns", name)
        self._ip("link", "set", b, "netns", self.switch)
        self._ip("link", "set", b, "master", f"{self.prefix}br", ns=self.switch)
        self._ip("link", "set", b, "up", ns=self.switch)
        self._ip("addr", "add", f"{self.ip(i)}/24", "dev", a, ns=name)
        self._ip("link", "set", a, "up", ns=name)
        return name

    def up_network(self) -> None:
        """The switch namespace with its bridge, and one namespace per host."""
        self._add_ns(self.switch)
        self._ip("link", "add", f"{self.prefix}br", "type", "bridge", ns=self.switch)
        self._ip("link", "set", f"{self.prefix}br", "up", ns=self.switch)
        for i in range(1, self.hosts + 1):
            self.add_host(i)

    # -- processes --------------------------------------------------------------------------------
    def exec(self, i: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``cmd`` in host ``i``'s namespace with the cluster's environment."""
        kwargs.setdefault("env", self.ray_env())
        return subprocess.run([IP, "netns", "exec", self.ns(i), *cmd], **kwargs)

    def popen(self, i: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        kwargs.setdefault("env", self.ray_env())
        return subprocess.Popen([IP, "netns", "exec", self.ns(i), *cmd], **kwargs)

    def start_ray(self, i: int, timeout_s: float = 180.0) -> None:
        """``ray start`` on host ``i`` (the head when ``i == 1``).

        Raises:
            RuntimeError: ``ray start`` failed (its output).
        """
        resources = self.head_resources if i == 1 else self.worker_resources
        cmd = [_ray_bin(), "start", f"--node-ip-address={self.ip(i)}", f"--num-cpus={self.num_cpus}",
               f"--object-store-memory={self.object_store_bytes}", f"--resources={json.dumps(dict(resources))}",
               "--disable-usage-stats"]
        if i == 1:
            cmd += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false", f"--temp-dir={self.temp_dir}",
                    f"--system-config={json.dumps({'worker_niceness': 0, **self.ray_system_config})}"]
        else:
            cmd += [f"--address={self.head_address}"]
        out = self.exec(i, cmd, capture_output=True, text=True, timeout=timeout_s, cwd=str(REPO))
        if out.returncode != 0:
            raise RuntimeError(f"ray start on {self.ns(i)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                               f"{out.stderr[-3000:]}")

    def wait_nodes(self, count: int, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """Wait until ``count`` Ray nodes are alive; returns them (``NodeManagerAddress``, ``Resources``)."""
        script = ("import json, ray; ray.init(address='auto', log_to_driver=False); "
                  "print(json.dumps([{k: n[k] for k in ('NodeID', 'NodeManagerAddress', 'Resources')} "
                  "for n in ray.nodes() if n['Alive']]))")
        deadline = time.monotonic() + timeout_s
        nodes: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            env = {**self.ray_env(), "RAY_ADDRESS": self.head_address}
            out = self.exec(1, [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
            if out.returncode == 0:
                nodes = json.loads(out.stdout.strip().splitlines()[-1])
                if len(nodes) >= count:
                    return nodes
            time.sleep(1.0)
        raise RuntimeError(f"{len(nodes)} of {count} Ray nodes alive after {timeout_s} s")

    def join_host(self, i: int) -> str:
        """A new host ``i`` on the bridge whose Ray worker joins the running cluster (``worker_resources``)."""
        name = self.add_host(i)
        self.start_ray(i)
        return name

    def pids(self, name: str) -> list[int]:
        out = subprocess.run([IP, "netns", "pids", name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process of host ``i``'s namespace (a host that dies); returns their pids."""
        killed = []
        for _ in range(5):  # a dying raylet may have forked: repeat until the namespace is empty
            pids = self.pids(self.ns(i))
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        return killed

    # -- whole cluster ----------------------------------------------------------------------------
    def up(self) -> NetnsCluster:
        """Network, then Ray on every host; on any failure everything made is removed and the error raised."""
        if not self.temp_dir:
            self.temp_dir = tempfile.mkdtemp(prefix=f"{self.prefix}-ray-")
        try:
            self.up_network()
            for i in range(1, self.hosts + 1):
                self.start_ray(i)
            self.wait_nodes(self.hosts)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill every process in every namespace made here, then delete the namespaces. Idempotent."""
        for name in reversed(self.made):
            for _ in range(5):
                pids = self.pids(name)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.3)
        for name in reversed(self.made):
            subprocess.run([IP, "netns", "del", name], capture_output=True)
        self.made.clear()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "namespaces": list(self.made), "head": self.head_address, "token": self.token,
                "temp_dir": self.temp_dir, "hosts": {self.ns(i): self.ip(i) for i in range(1, self.hosts + 1)}}


def main(argv: Sequence[str] | None = None) -> int:
    """``up``: build the cluster and print its description (JSON; also in ``--state``); ``down``: remove
    what ``up`` made (read from ``--state``)."""
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.netns_cluster", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--prefix", default="rxn")
    parser.add_argument("--subnet", default="10.77.0")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--num-cpus", type=int, default=1)
    parser.add_argument("--state", default=f"/tmp/{STATE_FILE}", help="where `up` writes what it made")
    args = parser.parse_args(argv)
    if args.action == "up":
        why = unavailable()
        if why:
            print(f"cannot build the cluster: {why}", file=sys.stderr)
            return 2
        cluster = NetnsCluster(prefix=args.prefix, subnet=args.subnet, hosts=args.hosts, num_cpus=args.num_cpus,
                               env={"PYTHONPATH": str(REPO)}).up()
        fd = os.open(args.state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(cluster.describe(), f)
        print(json.dumps(cluster.describe(), indent=1))
        return 0
    state = json.loads(Path(args.state).read_text())
    cluster = NetnsCluster(prefix=state["prefix"], temp_dir=state["temp_dir"], made=list(state["namespaces"]))
    cluster.down()
    Path(args.state).unlink()
    print(f"removed {', '.join(state['namespaces'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
