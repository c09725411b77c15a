"""Requests from Python: `Client` (sync, one request at a time) and `AsyncClient` (asyncio, many
requests in flight on one DEALER socket, matched by `id`). Errors raise `ServerError` with the
protocol's code; no reply within the client's own timeout raises `ClientTimeout`.

    from lipsync_client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        reply, images = c.composite("demo", audio=np.zeros((4, 32, 16, 16), np.float32), batch=4)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Optional, Sequence

import numpy as np
import zmq
import zmq.asyncio

from lipsync_client.contract import MOUTH_SHAPE
from lipsync_client import wire
from lipsync_client.wire import DEFAULT_ENDPOINT, Answer, ClientTimeout


class Client:
    """Synchronous client: one request at a time."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 60.0, curve: Optional[dict] = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._ctx = zmq.Context.instance()
        self._curve = curve
        self._sock = wire.new_socket(self._ctx, endpoint, curve)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, op: str, payload: Sequence = (), timeout_s: Optional[float] = None, **fields) -> Answer:
        rid = next(self._ids)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        wire.send_within(self._sock, [b"", wire.header(op, rid, **fields), *payload], timeout_s or self.timeout_s, op)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(int(remaining * 1000)):
                # A late reply must not be taken for the next request's: start over on a new socket.
                self._sock.close(linger=0)
                self._sock = wire.new_socket(self._ctx, self.endpoint, self._curve)
                raise ClientTimeout(f"no reply to {op} within {timeout_s or self.timeout_s:g}s from {self.endpoint}")
            frames = self._sock.recv_multipart()
            header = json.loads(frames[1])
            if header.get("id") in (rid, None):
                return wire.parse(frames[1:])

    def health(self) -> dict:
        return self.request("health")[0]

    def models(self, wait_s: float = 30.0) -> list[dict]:
        """Every model; waits up to `wait_s` for models whose files the server is still reading."""
        deadline = time.monotonic() + wait_s
        while True:
            models = self.request("models")[0]["models"]
            if not any(m.get("pending") for m in models) or time.monotonic() > deadline:
                return models
            time.sleep(0.1)

    def load(self, model: str, **kw) -> dict:
        return self.request("load", model=model, **kw)[0]

    def unload(self, model: str) -> dict:
        return self.request("unload", model=model)[0]

    def stats(self, model: Optional[str] = None) -> dict:
        return self.request("stats", model=model)[0]

    def infer(self, model: str, visual: np.ndarray, audio: np.ndarray, **kw) -> tuple[dict, np.ndarray]:
        header, frames = self.request("infer", wire.tensor_payload(visual, audio), model=model, batch=len(visual), **kw)
        return header, np.stack([np.frombuffer(f, "<f4").reshape(MOUTH_SHAPE) for f in frames])

    def composite(self, model: str, audio: np.ndarray, visual: Optional[np.ndarray] = None,
                  batch: Optional[int] = None, **kw) -> Answer:
        batch = batch or (len(visual) if visual is not None else len(audio))
        return self.request("composite", wire.tensor_payload(visual, audio), model=model, batch=batch, **kw)


class AsyncClient:
    """asyncio client: any number of requests in flight on one DEALER socket, matched by id."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 60.0, curve: Optional[dict] = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = wire.new_socket(self._ctx, endpoint, curve)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: Optional[asyncio.Task] = None
        self._closed = False

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the socket; requests still waiting for a reply raise ClientClosed."""
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)
        wire.fail_waiting(self._waiting, "the client")

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            header = json.loads(frames[1])
            future = self._waiting.pop(header.get("id"), None)
            if future is not None and not future.done():
                future.set_result(frames[1:])

    async def request(self, op: str, payload: Sequence = (), timeout_s: Optional[float] = None, **fields) -> Answer:
        if self._closed:
            raise wire.ClientClosed(f"the client is closed: {op} not sent")
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        rid = next(self._ids)
        future = self._waiting[rid] = asyncio.get_running_loop().create_future()
        sent = self._sock.send_multipart([b"", wire.header(op, rid, **fields), *payload], copy=False)

        async def answer() -> list:
            # NOTE: the send too: a socket whose handshake failed (keys the server refuses) never sends
            await sent
            return await future

        try:
            frames = await asyncio.wait_for(answer(), timeout_s or self.timeout_s)
        except asyncio.TimeoutError:
            self._waiting.pop(rid, None)
            raise ClientTimeout(f"no reply to {op} within {timeout_s or self.timeout_s:g}s") from None
        return wire.parse(frames)

    async def composite(self, model: str, audio: np.ndarray, visual: Optional[np.ndarray] = None,
                        batch: Optional[int] = None, **kw) -> Answer:
        batch = batch or (len(visual) if visual is not None else len(audio))
        return await self.request("composite", wire.tensor_payload(visual, audio), model=model, batch=batch, **kw)

    async def infer(self, model: str, visual: np.ndarray, audio: np.ndarray, **kw) -> Answer:
        return await self.request("infer", wire.tensor_payload(visual, audio), model=model, batch=len(visual), **kw)
