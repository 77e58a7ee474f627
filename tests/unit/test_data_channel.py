"""The data bus's same-node channel: calls run on the server's loop; a wrong key is refused."""

from __future__ import annotations

import asyncio
import threading
from multiprocessing import AuthenticationError

import pytest

from relax_agent.data.channel import ChannelClient, ChannelServer


@pytest.fixture()
def loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop, thread
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_calls_run_on_the_servers_loop_one_connection_per_thread(loop_thread):
    loop, thread = loop_thread
    release = asyncio.Event()

    async def handler(method: str, args: tuple):
        if method == "wait":
            await release.wait()
        return method, args, threading.current_thread() is thread

    server = ChannelServer(handler, loop)
    client = ChannelClient(server.address, server.authkey)
    blocked = []
    waiter = threading.Thread(target=lambda: blocked.append(client.call("wait", ())))
    waiter.start()
    assert client.call("put", (1, [2])) == ("put", (1, [2]), True)  # not stuck behind the waiting call
    loop.call_soon_threadsafe(release.set)
    waiter.join(5)
    assert blocked == [("wait", (), True)]
    server.close()


def test_a_wrong_key_is_refused_and_a_closed_server_raises_connection_error(loop_thread):
    loop, _ = loop_thread

    async def handler(method: str, args: tuple):
        return method

    server = ChannelServer(handler, loop)
    with pytest.raises(AuthenticationError):
        ChannelClient(server.address, b"x" * 32).call("m", ())
    client = ChannelClient(server.address, server.authkey)
    assert client.call("m", ()) == "m"  # the server still serves after refusing a client
    server.close()
    with pytest.raises(ConnectionError):
        ChannelClient(server.address, server.authkey).call("m", ())
