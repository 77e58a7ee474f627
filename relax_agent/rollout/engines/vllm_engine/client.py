"""HTTP to the vLLM server on 127.0.0.1: one ``httpx`` client on an asyncio loop that runs on its own
thread ("vllm-engine-io"), so blocking callers and other event loops submit coroutines to it.
Transport failures and error replies become :class:`~relax_agent.errors.EngineError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import httpx

from relax_agent.errors import EngineError
from relax_agent.rollout.engines.vllm_engine.process import STOP_JOIN_S


class ServerClient:
    """Calls to one server: ``port`` on 127.0.0.1, the bearer ``token``; error messages name ``log_path``
    (the server's log).

    Attributes:
        closed: set by the engine when it closes, so a call that fails then says so.
    """

    def __init__(self, port: int, token: str, log_path: Path) -> None:
        self._port = port
        self._log_path = log_path
        self.closed = False
        self._loop = asyncio.new_event_loop()
        self._io = threading.Thread(target=self._loop.run_forever, name="vllm-engine-io", daemon=True)
        self._io.start()
        self._client = self.call(self._make_client(token), 30.0)

    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Run ``coro`` on the io loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Any, timeout_s: float) -> Any:
        """Run ``coro`` on the io loop and wait for its result.

        Raises:
            EngineError: no result within ``timeout_s`` (``coro`` is cancelled), or what ``coro`` raised.
        """
        fut = self.submit(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError as exc:
            fut.cancel()
            raise EngineError(f"the vLLM server did not answer within {timeout_s:.0f} s") from exc

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` as JSON to ``path``; the JSON reply (EngineError: see :meth:`_send`)."""
        return await self._send(self._client.post(path, json=body), path)

    async def get(self, path: str) -> Any:
        """GET ``path``; the JSON reply (EngineError: see :meth:`_send`)."""
        return await self._send(self._client.get(path), path)

    def close(self) -> None:
        """Close the HTTP client and stop the io thread."""
        try:
            self.call(self._client.aclose(), 10.0)
        except EngineError:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._io.join(STOP_JOIN_S)

    async def _make_client(self, token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=f"http://127.0.0.1:{self._port}",
                                 headers={"Authorization": f"Bearer {token}"},
                                 timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def _send(self, request: Any, path: str) -> Any:
        """One HTTP call; transport failures and error replies become :class:`EngineError`."""
        try:
            response = await request
        except httpx.HTTPError as exc:
            why = "the engine was closed" if self.closed else f"{type(exc).__name__}: {exc}"
            raise EngineError(f"vLLM server {path}: {why}; log {self._log_path}") from exc
        if response.status_code != 200:
            raise EngineError(f"vLLM server {path} answered {response.status_code}: {response.text[:500]}; "
                              f"log {self._log_path}")
        return response.json()
