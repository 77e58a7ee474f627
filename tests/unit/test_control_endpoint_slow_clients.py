"""The control endpoint under clients that hold its connections: one byte every few seconds never looked
idle, so 17 such connections kept the owner out (503) for good, and ``relax-agent scale`` then crashed
with a raw JSONDecodeError on the 503's empty body."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from relax_agent.errors import ConfigError


class FakeSupervisor:
    def __init__(self):
        self.target = 1

    def status(self):
        return {"target": self.target}

    def scale(self, rollout):
        self.target = int(rollout)
        return self.status()


def _trickle(url: str, stop: threading.Event, closed: list[float]) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)

    def run():
        start = time.monotonic()
        try:
            sock.sendall(b"G")
            while not stop.wait(0.3):
                sock.sendall(b"E")  # never idle: the idle timeout alone would not end it
        except OSError:
            closed.append(time.monotonic() - start)

    threading.Thread(target=run, daemon=True).start()
    return sock


def test_trickling_clients_are_cut_at_the_request_deadline_and_the_owner_gets_in(tmp_path):
    from relax_agent.runtime.ray_control import ControlServer, scale_run

    server = ControlServer(FakeSupervisor(), tmp_path, idle_timeout_s=5.0, request_timeout_s=1.5, max_connections=2)
    stop, closed = threading.Event(), []
    socks = [_trickle(server.url, stop, closed) for _ in range(2)]
    try:
        time.sleep(0.3)  # both slots are taken now
        start = time.monotonic()
        assert scale_run(tmp_path, 3, timeout_s=30)["target"] == 3  # retried through the 503s
        assert time.monotonic() - start < 30
        deadline = time.monotonic() + 20
        while len(closed) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(closed) == 2  # each trickler was cut, though it never stopped sending
    finally:
        stop.set()
        for s in socks:
            s.close()
        server.close()


def test_a_controller_that_stays_busy_is_a_clear_error_not_a_json_crash(tmp_path):
    from relax_agent.runtime.ray_control import ControlServer, scale_run

    server = ControlServer(FakeSupervisor(), tmp_path, idle_timeout_s=30.0, request_timeout_s=60.0, max_connections=1)
    stop, closed = threading.Event(), []
    sock = _trickle(server.url, stop, closed)
    try:
        time.sleep(0.3)
        with pytest.raises(ConfigError, match=r"HTTP 503 \(every connection slot stayed taken\) \(no body\)"):
            scale_run(tmp_path, 3, timeout_s=1.0)
    finally:
        stop.set()
        sock.close()
        server.close()
