"""A same-node shortcut to the Ray backend's metadata actor: an authenticated Unix socket.

A Ray actor call costs a task submission and a scheduler round trip (about 1-2 ms on a busy
2-core machine); the bus's hot calls (a single-row put, an ack, a small get) carry a few
kilobytes. Processes on the actor's node therefore send calls that hold no object references
over a ``multiprocessing.connection`` Unix socket (pickle frames, HMAC handshake with a random
key that only Ray hands out); the actor runs them on its own event loop, so the socket and
Ray paths see one state. Calls carrying object references keep using Ray, which tracks them.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Awaitable, Callable

Handler = Callable[[str, tuple], Awaitable[Any]]


class ChannelServer:
    """Accepts connections on a fresh Unix socket; each connection gets a thread that runs
    ``handler(method, args)`` on ``loop`` and sends back its result (one call at a time per
    connection, so a blocked ``get`` holds only its own connection)."""

    def __init__(self, handler: Handler, loop: asyncio.AbstractEventLoop) -> None:
        self.authkey = os.urandom(32)
        self._dir = tempfile.mkdtemp(prefix="relax-tq-")
        self.address = os.path.join(self._dir, "bus.sock")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self._handler, self._loop = handler, loop
        threading.Thread(target=self._accept, name="relax-tq-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except AuthenticationError:
                continue
            except OSError:  # listener closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="relax-tq-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    method, args = conn.recv()
                except (EOFError, OSError):
                    return
                result = asyncio.run_coroutine_threadsafe(self._handler(method, args), self._loop).result()
                try:
                    conn.send(result)
                except OSError:
                    return

    def close(self) -> None:
        self._listener.close()  # also removes the socket file
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


class ChannelClient:
    """Calls a :class:`ChannelServer`; one connection per calling thread."""

    def __init__(self, address: str, authkey: bytes) -> None:
        self._address, self._authkey = address, authkey
        self._local = threading.local()

    def call(self, method: str, args: tuple) -> Any:
        """Send one call and wait for its result.

        Raises:
            ConnectionError: the server is gone (the connection is dropped; the next call reconnects).
        """
        conn = getattr(self._local, "conn", None)
        try:
            if conn is None:
                conn = self._local.conn = Client(self._address, family="AF_UNIX", authkey=self._authkey)
            conn.send((method, args))
            return conn.recv()
        except (EOFError, OSError) as exc:
            self._local.conn = None
            raise ConnectionError(f"data-bus channel {self._address} closed: {exc}") from exc
