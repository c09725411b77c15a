"""The client SDK's own promises, with no server needed to keep them: closing ends what waits, and a
server that refuses the client's keys gets its requests timed out, never hung."""

from __future__ import annotations

import asyncio
import threading
import time

import zmq

from lipsync_client import AsyncClient, AsyncSession, Client, ClientClosed, ClientTimeout
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


def _refusing_server() -> tuple[zmq.Socket, str]:
    """A ROUTER that takes CURVE clients only: a client without keys fails its handshake there. (Its own
    context: a ZAP handler another test left on the shared one would hold the handshake open instead.)"""
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.linger = 0
    _, secret = zmq.curve_keypair()
    sock.curve_server, sock.curve_secretkey = True, secret
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _handshake_failed(sock: zmq.Socket) -> None:
    """Until the socket has nowhere to queue a message: its connection failed the handshake and is gone
    (a send would then block for good)."""
    deadline = time.monotonic() + TIMEOUT_S   # (a liveness bound: it takes some 100 ms)
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
        assert time.monotonic() < deadline, "the handshake never failed"
        time.sleep(0.01)


def test_requests_of_a_client_whose_keys_the_server_refuses_time_out_and_never_hang():
    """A client that connects without the keys a server asks for fails its handshake, and its socket then
    takes no message: each request of the client, the session and their async forms ends ClientTimeout
    at its timeout, where its send used to block for good."""
    server, endpoint = _refusing_server()
    try:
        with Client(endpoint, timeout_s=1) as client:
            _handshake_failed(client._sock)
            outcome: list = []

            def ask() -> None:
                try:
                    outcome.append(client.health())
                except Exception as err:
                    outcome.append(err)

            asking = threading.Thread(target=ask, daemon=True)   # (a hung send stays in its own thread)
            asking.start()
            asking.join(TIMEOUT_S)
            assert not asking.is_alive(), "the request still hangs"
            assert isinstance(outcome[0], ClientTimeout) and "not sent" in str(outcome[0]), outcome

        async def scenario() -> list:
            client = AsyncClient(endpoint, timeout_s=1)
            session = AsyncSession(endpoint, "a", timeout_s=1)
            _handshake_failed(client._sock)
            _handshake_failed(session._sock)
            ended = await asyncio.wait_for(asyncio.gather(client.request("health"), session.__aenter__(),
                                                          return_exceptions=True), TIMEOUT_S)
            await client.close()
            session._sock.close(linger=0)
            return ended

        ended = asyncio.run(scenario())
        assert all(isinstance(e, ClientTimeout) for e in ended), ended
    finally:
        server.close()
        server.context.term()
