"""The client SDK's own promises, with no server needed to keep them: closing ends what waits."""

from __future__ import annotations

import asyncio
import time

from lipsync_client import AsyncClient, ClientClosed
from tests.helpers import free_port

TIMEOUT_S = 30.0


def test_closing_a_client_ends_its_requests_in_flight_at_once_and_refuses_later_ones():
    """Nothing answers at the endpoint, so a request waits for its reply; closing the client ends it with
    ClientClosed then, not at its timeout, and a request after the close is refused."""
    async def scenario() -> tuple[BaseException, float, BaseException]:
        client = AsyncClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=TIMEOUT_S)
        waiting = asyncio.ensure_future(client.request("health"))
        while not waiting.done() and not client._waiting:   # (until it waits for its reply)
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await client.close()
        ended = (await asyncio.gather(waiting, return_exceptions=True))[0]
        took = time.monotonic() - t0
        later = (await asyncio.gather(client.request("health"), return_exceptions=True))[0]
        return ended, took, later

    ended, took, later = asyncio.run(scenario())
    assert isinstance(ended, ClientClosed), repr(ended)
    assert "closed before the reply came" in str(ended)
    assert took < TIMEOUT_S / 2, took
    assert isinstance(later, ClientClosed) and "not sent" in str(later), repr(later)
