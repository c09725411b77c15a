"""ZeroMQ CURVE keys for every socket that faces a network: the key files the config names, an allow
list, the authenticator, and the socket settings of a CURVE server or client.

Key pairs come from `python -m supervisor keys DIR NAME` (pyzmq's `zmq.auth.create_certificates`):
DIR/NAME.key is the public key (share it), DIR/NAME.key_secret the secret one (keep it).
A server accepts only the public keys it lists; every refusal is logged with the key.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import zmq

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

# NOTE: zmq.auth is imported where a key is read or an authenticator started: 18 ms that a server
# without CURVE (the frontend's default) does not pay at start.

log = logging.getLogger(__name__)


class KeyError_(ValueError):
    """A key file is missing or unreadable; the message names the file and the config key."""

    # No restart can cure it: the child reports it as permanent and the supervisor ends the server
    # (shm/child.py, CannotServe; config imports no other room, so it says so by this attribute).
    permanent = True


def load_public(path: str | Path, setting: str) -> bytes:
    import zmq.auth
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as err:
        raise KeyError_(f"{setting}: cannot read public key file {path}: {err}") from None
    return public


def load_pair(path: str | Path, setting: str) -> tuple[bytes, bytes]:
    import zmq.auth
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as err:
        raise KeyError_(f"{setting}: cannot read key file {path}: {err}") from None
    if secret is None:
        raise KeyError_(f"{setting}: {path} holds no secret key (use the .key_secret file)")
    return public, secret


def public_keys_in(directory: str | Path, setting: str) -> list[bytes]:
    d = Path(directory)
    if not d.is_dir():
        raise KeyError_(f"{setting}: {d} is not a directory of public key files")
    return [load_public(p, setting) for p in sorted(d.glob("*.key"))]


class _AllowList:
    def __init__(self, allowed: Callable[[bytes], bool], what: str):
        self._allowed, self._what = allowed, what

    def callback(self, domain: str, z85_key: bytes) -> bool:
        ok = self._allowed(z85_key)
        if not ok:
            log.warning("%s: refused a client with unknown CURVE key %s", self._what, z85_key.decode())
        return ok


def start_authenticator(ctx: zmq.Context, allowed_z85: Iterable[bytes], what: str) -> ThreadAuthenticator:
    """One ZAP handler per context: accept exactly the given public keys (z85), log the rest."""
    from zmq.auth.thread import ThreadAuthenticator
    keys = {bytes(k) for k in allowed_z85}
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("zmq.auth"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_AllowList(keys.__contains__, what))
    return auth


def make_server(sock: zmq.Socket, secret_key_file: str, setting: str) -> None:
    public, secret = load_pair(secret_key_file, setting)
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True


def make_client(sock: zmq.Socket, secret_key_file: str, server_key_file: str, setting: str) -> None:
    public, secret = load_pair(secret_key_file, f"{setting}.client_secret_key")
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = load_public(server_key_file, f"{setting}.server_key")
