"""frontend/client/ is the Python client SDK and its command line: requests (`Client`, `AsyncClient`),
live sessions (`Session`, `AsyncSession`), the wire helpers they share, and `python -m frontend.client`;
the voice-agent integrations (pipecat.py, livekit.py) and examples/ on them, loaded only when imported.

May import: frontend.protocol, and config's pure constants (config.audio, config.geometry); never the
server's rooms (core, server, live, bridge) nor its config loader: a client installs nothing of the server.
"""

from frontend.client.requests import AsyncClient, Client
from frontend.client.sessions import AsyncSession, Frame, Session
from frontend.client.wire import DEFAULT_ENDPOINT, ClientTimeout, ServerError, curve_keys

__all__ = ["AsyncClient", "AsyncSession", "Client", "ClientTimeout", "DEFAULT_ENDPOINT", "Frame", "ServerError",
           "Session", "curve_keys"]
