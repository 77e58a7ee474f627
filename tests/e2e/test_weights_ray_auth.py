"""The weight coordinator Ray actor against a stranger joined to the run's Ray (issue 30, items 1-2).

A stranger is a Ray task in its own worker process that looks the run's coordinator up by name:
it can neither commit (or retract, or register as the publisher), subscribe, poll, nor download
the weights from the trainer's tcp port; the run's replica keeps the trainer's weights and follows
the trainer's next publish.
"""

from __future__ import annotations

import socket
import struct
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from relax_agent.runtime.ray_weights import ActorCoordinator, start_coordinator  # noqa: E402
from relax_agent.weights import EngineSubscriber, TensorEngine, WeightSyncConfig  # noqa: E402
from relax_agent.weights.auth import RunCredential  # noqa: E402
from relax_agent.weights.meta import VersionMeta, plan_layout  # noqa: E402
from relax_agent.weights.sync import WeightSync  # noqa: E402
from relax_agent.weights.tcp import TcpReceiver, TcpSender  # noqa: E402

pytestmark = pytest.mark.slow

NAME, NS = "auth-test.weights", "relax-auth-test"


@pytest.fixture(scope="module")
def ray_session():
    from relax_agent.data.ray import LOCAL_RAY_SYSTEM_CONFIG

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8, 8), value), "b": torch.full((8,), value)}


def forged_meta(version: int, address: str) -> VersionMeta:
    tensors, total = plan_layout(state(0.0))
    return VersionMeta(version, tensors, total, 1024, "none", (), "tcp", address)


@ray.remote(num_cpus=0)
def stranger(weight_address: str, replica_credential: RunCredential) -> dict[str, str]:
    """Everything a process joined to the run's Ray tries; returns what each attempt got."""
    handle = ray.get_actor(NAME, namespace=NS)
    evil = forged_meta(10**6, "127.0.0.1:1")
    attempts = {
        "commit": lambda: handle.call.remote("commit", evil),
        "commit_guessed": lambda: handle.call.remote("commit", evil, credential=RunCredential("guess", "guess"),
                                                     publisher="guess"),
        "commit_as_replica": lambda: handle.call.remote("commit", evil, credential=replica_credential,
                                                        publisher="guess"),
        "retract": lambda: handle.call.remote("retract", 1),
        "register_publisher": lambda: handle.register_publisher.remote("127.0.0.1:1"),
        "close": lambda: handle.call.remote("close", credential=replica_credential),
        "subscribe": lambda: handle.call.remote("register_subscriber", "stranger"),
        "latest": lambda: handle.call.remote("latest"),
        "poll": lambda: handle.call.remote("wait_for_version", None, 0.0),
    }
    out = {}
    for what, attempt in attempts.items():
        try:
            out[what] = f"ACCEPTED: {ray.get(attempt())!r}"
        except ray.exceptions.RayTaskError as exc:
            out[what] = str(exc.cause if hasattr(exc, "cause") else exc)
    host, _, port = weight_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:  # the tcp port, protocol of old
        conn.sendall(struct.pack("!4sqq", b"RLXW", 1, 0))
        conn.shutdown(socket.SHUT_WR)
        got = bytearray()
        while chunk := conn.recv(1 << 16):
            got += chunk
    out["download_bytes"] = str(len(got))
    return out


def test_a_stranger_joined_to_the_run_s_ray_can_neither_publish_subscribe_nor_download(ray_session):
    credential = RunCredential.generate()
    trainer_side = ActorCoordinator(start_coordinator(NAME, NS, credential), credential)
    replica_side = trainer_side.for_subscribers()
    cfg = WeightSyncConfig(transport="tcp", publish_timeout_s=60.0)
    sender = TcpSender(cfg, credential.subscriber)
    sync = WeightSync(cfg, trainer_side, sender, None)
    engine = TensorEngine(state(0.0))
    sub = EngineSubscriber(engine, TcpReceiver(cfg, secret=credential.subscriber), replica_side, "replica").start()
    try:
        assert sync.publish(state(1.0), 1).subscribers == 1 and engine.policy_version == 1

        got = ray.get(stranger.remote(sender.address, credential.subscriber_only()), timeout=120)
        accepted = {k: v for k, v in got.items() if v.startswith("ACCEPTED")}
        assert accepted == {}, accepted
        for what in ("commit", "commit_guessed", "commit_as_replica", "retract", "register_publisher"):
            assert "needs the run's publisher credential" in got[what], (what, got[what])
        for what in ("subscribe", "latest", "poll"):
            assert "needs the run's subscriber credential" in got[what], (what, got[what])
        assert "unknown method 'close'" in got["close"]
        assert got["download_bytes"] == "36"  # the challenge; not one byte of a weight

        # nothing changed: same epoch, same latest version, the replica kept the trainer's weights
        assert trainer_side.latest_version == 1 and replica_side.latest().version == 1
        assert engine.policy_version == 1 and torch.equal(engine.tensors["w"], state(1.0)["w"])
        assert replica_side.describe()["subscribers"] == [sub.id]
        # and the trainer's next publish goes through to it
        stats = sync.publish(state(2.0), 2)
        assert stats.subscribers == 1 and stats.lagging == ()
        assert engine.policy_version == 2 and torch.equal(engine.tensors["w"], state(2.0)["w"])
        # the replica's own credential cannot publish either
        with pytest.raises(Exception, match="needs the run's publisher credential"):
            replica_side.commit(forged_meta(3, sender.address), publisher="x")
    finally:
        sub.close()
        sync.close()
        ray.kill(trainer_side.handle)


def test_a_driver_finding_another_run_s_coordinator_under_its_name_is_refused(ray_session):
    from relax_agent.errors import WeightSyncError

    first = start_coordinator("auth-test.other", NS, RunCredential.generate())
    try:
        with pytest.raises(WeightSyncError, match="belongs to another run"):
            start_coordinator("auth-test.other", NS, RunCredential.generate())
    finally:
        ray.kill(first)


@ray.remote(num_cpus=0)
def stranger_at_the_trainer(name: str) -> dict[str, str]:
    """A process joined to the run's Ray calls the (named) trainer actor as the run's driver would."""
    handle = ray.get_actor(name, namespace=NS)
    out = {}
    for what, ref in (("state_dict", lambda: handle.state_dict.remote()),
                      ("publish", lambda: handle.publish.remote(99)),
                      ("train", lambda: handle.train.remote({}, 99)),
                      ("guessed", lambda: handle.state_dict.remote(credential=RunCredential("g", "g")))):
        try:
            out[what] = f"ACCEPTED: {ray.get(ref())!r}"
        except ray.exceptions.RayTaskError as exc:
            out[what] = str(exc)
    return out


def test_a_stranger_joined_to_the_run_s_ray_cannot_call_the_trainer_actor(ray_session):
    """The trainer actor (named, so anyone joined to Ray finds it) reads, trains and publishes only for
    the holder of the run's publisher credential."""
    from relax_agent.runtime.ray_trainer import TrainerActor

    credential = RunCredential.generate()
    coordinator = ActorCoordinator(start_coordinator("auth-test.trainer-weights", NS, credential), credential)
    name = "auth-test.trainer.1"
    actor = ray.remote(TrainerActor).options(name=name, namespace=NS, num_cpus=0).remote(
        None, "trainer", coordinator, None, "127.0.0.1", None)
    try:
        got = ray.get(stranger_at_the_trainer.remote(name), timeout=120)
        assert all("needs the run's publisher credential" in v for v in got.values()), got
        # the run's own call passes the check (and then finds no trainer built in this bare actor)
        with pytest.raises(ray.exceptions.RayTaskError, match="'NoneType' object has no attribute 'state_dict'"):
            ray.get(actor.state_dict.remote(credential=credential), timeout=60)
        # a replica's credential (no publisher secret) is refused too
        with pytest.raises(ray.exceptions.RayTaskError, match="needs the run's publisher credential"):
            ray.get(actor.state_dict.remote(credential=credential.subscriber_only()), timeout=60)
    finally:
        ray.kill(actor)
        ray.kill(coordinator.handle)
