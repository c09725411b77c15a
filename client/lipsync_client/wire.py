"""The client SDK's side of the wire (docs/protocol.md): request headers, reply parsing, errors and the
DEALER socket every client and session uses (empty delimiter first, as the protocol says)."""

from __future__ import annotations

import json
from typing import Optional

import numpy as np
import zmq

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
Answer = tuple[dict, list]   # a reply's header and its data frames


class ServerError(Exception):
    """The server answered `ok: false`; `code` is one of the protocol's error codes."""

    def __init__(self, code: str, message: str, reply: Optional[dict] = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.reply = code, message, reply

    @property
    def retry_after_s(self) -> Optional[float]:
        """`busy`: how long until the server may have room (error.retry_after_ms); None if it did not say."""
        ms = ((self.reply or {}).get("error") or {}).get("retry_after_ms")
        return None if ms is None else ms / 1000


class ClientTimeout(TimeoutError):
    """No reply within the client's own timeout (the server may be down or restarting)."""


class ClientClosed(ConnectionError):
    """The client or session was closed with the request still waiting for its reply (or before it)."""


def fail_waiting(waiting: dict, what: str) -> None:
    """On close: every request still waiting for its reply ends now with ClientClosed, not at its timeout."""
    for future in waiting.values():
        if not future.done():
            future.set_exception(ClientClosed(f"{what} was closed before the reply came"))
    waiting.clear()


def tensor_payload(visual: Optional[np.ndarray], audio: np.ndarray) -> list:
    frames = [] if visual is None else [np.ascontiguousarray(visual, dtype="<f4")]
    return frames + [np.ascontiguousarray(audio, dtype="<f4")]


def header(op: str, rid: int, **fields) -> bytes:
    return json.dumps({"op": op, "id": rid, **{k: v for k, v in fields.items() if v is not None}}).encode()


def parse(frames: list) -> Answer:
    header = json.loads(bytes(frames[0]))
    if not header.get("ok"):
        err = header.get("error", {})
        raise ServerError(err.get("code", "internal"), err.get("message", ""), header)
    return header, frames[1:]


def curve_keys(secret_key_file: str, server_key_file: str) -> dict:
    """CURVE keys for a client: its own pair (the .key_secret file) and the server's public key."""
    import zmq.auth
    public, secret = zmq.auth.load_certificate(secret_key_file)
    server, _ = zmq.auth.load_certificate(server_key_file)
    return {"public": public, "secret": secret, "server": server}


def send_within(sock, parts: list, timeout_s: float, what: str) -> None:
    """Send a request's parts, waiting at most `timeout_s` for the socket to take them. A socket whose
    connection failed its handshake (a server that refuses this client's CURVE keys) has nowhere to
    queue a message, and its send would block for good."""
    if not sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
        raise ClientTimeout(f"{what} not sent within {timeout_s:g}s: no connection takes it (is the server up, "
                            "and does it accept this client's CURVE keys?)")
    sock.send_multipart(parts, copy=False)


def new_socket(ctx, endpoint: str, curve: Optional[dict]):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        sock.curve_secretkey, sock.curve_publickey = curve["secret"], curve["public"]
        sock.curve_serverkey = curve["server"]
    sock.connect(endpoint)
    return sock
