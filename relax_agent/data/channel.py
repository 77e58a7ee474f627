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
import pickle
import tempfile
import threading
from collections.abc import Callable, Coroutine
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from relax_agent.errors import DataError

Handler = Callable[[str, tuple], Coroutine[Any, Any, Any]]


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class ChannelServer:
    """Accepts connections on a fresh Unix socket; each connection gets a thread that runs
    ``handler(method, args)`` on ``loop`` and sends back its result (one call at a time per
    connection, so a blocked ``get`` holds only its own connection). Replies are ``(ok, value)``
    pairs: a call that cannot be unpickled here, or a reply that cannot be pickled, is answered
    with ``(False, DataError)`` and the connection stays up."""

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
                    frame = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    method, args = pickle.loads(frame)
                except Exception as exc:  # a value this process cannot unpickle: refuse the call, keep the connection
                    result: Any = (False, DataError(f"data-bus channel: a call could not be unpickled in the metadata "
                                                    f"actor's process ({type(exc).__name__}: {exc}); put values "
                                                    "whose classes every process of the cluster can import"))
                else:
                    result = asyncio.run_coroutine_threadsafe(self._handler(method, args), self._loop).result()
                try:
                    reply = _dumps(result)
                except Exception as exc:
                    reply = _dumps((False, DataError(f"data-bus channel: the reply to {method!r} could not be pickled "
                                                     f"({type(exc).__name__}: {exc})")))
                try:
                    conn.send_bytes(reply)
                except OSError:
                    return

    def close(self) -> None:
        """Stop accepting connections and remove the socket and its folder."""
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
            DataError: the call cannot be pickled (nothing is sent).
            ConnectionError: the server is gone (the connection is dropped; the next call reconnects).
        """
        try:
            frame = _dumps((method, args))
        except Exception as exc:
            raise DataError(f"data-bus {method}: the call cannot be pickled ({type(exc).__name__}: {exc}); "
                            "values on the bus must pickle (no lambdas or local classes)") from exc
        conn = getattr(self._local, "conn", None)
        try:
            if conn is None:
                conn = self._local.conn = Client(self._address, family="AF_UNIX", authkey=self._authkey)
            conn.send_bytes(frame)
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            self._local.conn = None
            raise ConnectionError(f"data-bus channel {self._address} closed: {exc}") from exc
