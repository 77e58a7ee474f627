"""Several hosts (issue 25, item 5) without a cluster: what each listener binds and advertises, the
placement options, and the refusal of an unauthenticated listener off loopback."""

from __future__ import annotations

import json
import socket

import pytest

from relax_agent.config import load_config
from relax_agent.errors import ConfigError
from relax_agent.netaddr import advertised, check_listener, is_loopback, is_wildcard


def test_loopback_and_wildcard_addresses_are_told_apart():
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost", "10.77.0.1", "0.0.0.0",
                                     "example.org")] == [True, True, True, True, False, False, False]
    assert [is_wildcard(h) for h in ("0.0.0.0", "::", "127.0.0.1", "10.77.0.1")] == [True, True, False, False]
    assert advertised("0.0.0.0", "10.77.0.2") == "10.77.0.2"
    assert advertised("10.77.0.1", "10.77.0.2") == "10.77.0.1"  # a named address is advertised as is


def test_an_unauthenticated_listener_is_refused_off_loopback_naming_the_key():
    check_listener("--host", "127.0.0.1", authenticated=False)
    check_listener("--host", "0.0.0.0", authenticated=True)
    with pytest.raises(ConfigError, match=r"--host='0\.0\.0\.0'.*loopback"):
        check_listener("--host", "0.0.0.0", authenticated=False)


def test_serve_reward_refuses_a_non_loopback_host_without_a_token(capsys):
    import typer

    from relax_agent.reward_services.cli import serve_reward

    with pytest.raises(typer.Exit) as exc:
        serve_reward("examples.custom_reward.reward:score", host="0.0.0.0", port=1, token_env=None)
    assert exc.value.exit_code == 2
    assert "--host='0.0.0.0'" in capsys.readouterr().err


def _cfg(*overrides):
    return load_config(None, ["runtime=ray", "mode=async", "weights.transport=tcp", *overrides])


def test_the_weight_server_binds_the_trainer_node_when_joining_a_cluster_and_advertises_it_for_a_wildcard():
    from relax_agent.runtime.ray import weight_server_host

    node = "10.77.0.1"
    assert weight_server_host(_cfg(), node) == ("127.0.0.1", "127.0.0.1")  # one host: unchanged
    assert weight_server_host(_cfg("data.ray_address=10.77.0.1:6379"), node) == (node, node)
    assert weight_server_host(_cfg("weights.host=0.0.0.0"), node) == ("0.0.0.0", node)
    joined_wildcard = _cfg("data.ray_address=10.77.0.1:6379", "weights.host=0.0.0.0")
    assert weight_server_host(joined_wildcard, node) == ("0.0.0.0", node)
    assert weight_server_host(_cfg("weights.host=10.77.0.9"), node) == ("10.77.0.9", "10.77.0.9")


def test_a_tcp_weight_server_bound_everywhere_advertises_the_given_address():
    from relax_agent.weights import WeightSyncConfig
    from relax_agent.weights.tcp import TcpSender

    sender = TcpSender(WeightSyncConfig(transport="tcp", host="0.0.0.0"), "s", advertise="127.0.0.2")
    try:
        host, port = sender.address.split(":")
        assert host == "127.0.0.2" and int(port) > 0
        with socket.create_connection(("127.0.0.2", int(port)), timeout=5) as conn:
            assert conn.recv(4) == b"RLXN"  # it listens there too, and challenges first
    finally:
        sender.close()
    assert TcpSender(WeightSyncConfig(transport="tcp"), "s").address.startswith("127.0.0.1:")


def test_placement_keys_become_ray_resources_and_must_be_positive():
    from relax_agent.runtime.ray import placement

    cfg = _cfg('runtime.rollout_resources={"rollout_host": 0.01}', 'runtime.trainer_resources={"head_host": 0.01}')
    assert placement(cfg.runtime.rollout_resources) == {"resources": {"rollout_host": 0.01}}
    assert placement(cfg.runtime.trainer_resources) == {"resources": {"head_host": 0.01}}
    assert placement(_cfg().runtime.rollout_resources) == {}
    assert placement({"rollout_host": 1.0}, spread=True) == {"resources": {"rollout_host": 1.0},
                                                              "scheduling_strategy": "SPREAD"}
    with pytest.raises(ConfigError, match="rollout_resources"):
        _cfg('runtime.rollout_resources={"rollout_host": 0}')


def test_the_control_endpoint_binds_the_configured_host_and_writes_the_advertised_url(tmp_path):
    import httpx

    from relax_agent.runtime.ray_control import ControlServer
    from relax_agent.runtime.ray_rollout import ReplicaPool
    from relax_agent.runtime.ray_supervisor import Supervisor

    supervisor = Supervisor(_cfg(), ReplicaPool(), None, None, None, "p", "ns")
    server = ControlServer(supervisor, tmp_path, host="0.0.0.0", advertise="127.0.0.3")
    try:
        info = json.loads((tmp_path / "runtime.json").read_text())
        assert info["url"].startswith("http://127.0.0.3:")
        assert httpx.get(f"{info['url']}/status").status_code == 401  # every caller needs the token
        ok = httpx.get(f"{info['url']}/status", headers={"Authorization": f"Bearer {info['token']}"})
        assert ok.status_code == 200 and ok.json()["target"] == 1
    finally:
        server.close()
    with pytest.raises(ConfigError, match="runtime.control_host"):
        ControlServer(supervisor, tmp_path, host="10.255.255.254")  # not an address of this host


def test_scale_is_bounded_by_the_hosts_custom_resources(monkeypatch):
    """Two hosts with ``rollout_host: 2`` each hold 4 replicas at ``{"rollout_host": 1}``, whatever the CPUs."""
    from relax_agent.runtime import ray_supervisor
    from relax_agent.runtime.ray_rollout import ReplicaPool
    from relax_agent.runtime.ray_supervisor import Supervisor

    supervisor = Supervisor(_cfg('runtime.rollout_resources={"rollout_host": 1}'), ReplicaPool(), None, None, None,
                            "p", "ns")
    monkeypatch.setattr(ray_supervisor.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_supervisor.ray, "cluster_resources", lambda: {"CPU": 16.0, "rollout_host": 4.0})
    bound, why = supervisor.max_replicas()
    assert bound == 4 and "'rollout_host'" in why and "runtime.rollout_resources" in why
    with pytest.raises(ConfigError, match="more than the 4 rollout replicas"):
        supervisor.scale(5)
    assert supervisor.scale(4)["target"] == 4


def test_joining_a_cluster_without_ray_token_auth_is_warned_about(monkeypatch, caplog):
    from relax_agent.runtime.ray import warn_open_cluster

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert warn_open_cluster(_cfg()) is False  # a local Ray of the run's own
    with caplog.at_level("WARNING", logger="relax_agent.runtime"):
        assert warn_open_cluster(_cfg("data.ray_address=10.77.0.1:6379")) is True
    assert "RAY_AUTH_MODE=token" in caplog.text and "data bus" in caplog.text
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert warn_open_cluster(_cfg("data.ray_address=10.77.0.1:6379")) is False


def test_the_netns_cluster_skips_naming_why_without_root(monkeypatch):
    from tests.e2e import netns_cluster

    monkeypatch.setattr(netns_cluster.os, "geteuid", lambda: 1000)
    assert netns_cluster.unavailable() == "network namespaces need root (CI runs as root)"
    monkeypatch.setattr(netns_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns_cluster, "IP", "/nonexistent/ip")
    assert netns_cluster.unavailable() == "no `ip` command (iproute2) at /nonexistent/ip"
