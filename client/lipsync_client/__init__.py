"""lipsync_client is the light client of lipsync-serve: requests (`Client`, `AsyncClient`), live sessions
(`Session`, `AsyncSession`), the wire helpers they share, `python -m lipsync_client`; the wire protocol
(protocol.py) and its numbers (contract.py), which the server imports from here; the voice-agent
integrations (pipecat.py, livekit.py) and examples/ on them, loaded only when imported.

Imports nothing of the server: installing it installs none of the server's packages or dependencies.
Its names below are imported on first use (PEP 562), so that the server, which imports only the
protocol and its numbers, loads no client socket code (pyzmq) with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lipsync_client.requests import AsyncClient, Client
    from lipsync_client.sessions import AsyncSession, Frame, Session
    from lipsync_client.wire import DEFAULT_ENDPOINT, ClientClosed, ClientTimeout, ServerError, curve_keys

_HOMES = {"AsyncClient": "lipsync_client.requests", "Client": "lipsync_client.requests",
          "AsyncSession": "lipsync_client.sessions", "Frame": "lipsync_client.sessions",
          "Session": "lipsync_client.sessions", "DEFAULT_ENDPOINT": "lipsync_client.wire",
          "ClientClosed": "lipsync_client.wire", "ClientTimeout": "lipsync_client.wire",
          "ServerError": "lipsync_client.wire",
          "curve_keys": "lipsync_client.wire"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'lipsync_client' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
