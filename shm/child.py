"""The common life of every child process: title, log prefix, faulthandler, READY, death report.

Each role's entry is `run_<role>_process(config, run, index)`, which calls `child_main` with a
builder for its actor. The actor reports READY only once built (sockets bound, shm attached);
an exception is reported to the supervisor (in-band death) before the process exits non-zero.
An error that no restart can cure (`CannotServe`: a port another program holds, a key file that
cannot be read) ends the process with EXIT_PERMANENT, and the supervisor ends the server instead of
restarting it.
SIGINT is ignored (the supervisor owns Ctrl-C); SIGTERM asks the actor to stop.
"""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import logging
import os
import signal
import socket
import sys
import traceback
from typing import Callable, Optional, Protocol

import zmq

from shm.endpoints import RunSpec, make_socket
from shm.codes import ProcState
from shm.messages import Fatal, Ready, pack


# The exit status of a child that died of an error no restart can cure (os.EX_CONFIG, sysexits.h): the
# supervisor reads it off the process sentinel, so it holds even where the Fatal report came late.
EXIT_PERMANENT = 78


class CannotServe(Exception):
    """No restart can cure this (a port another program holds, a key file that cannot be read): the
    supervisor ends the whole server, non-zero, instead of restarting the child. The message names the
    setting to change. A room that cannot import this one (config's key errors) marks its own
    exception class `permanent = True` instead."""

    permanent = True


def _taken(errno_: Optional[int]) -> str:
    return "; another program holds it" if errno_ == errno.EADDRINUSE else ""


def bind_endpoint(sock: zmq.Socket, endpoint: str, setting: str) -> None:
    """Bind a ZeroMQ socket to an endpoint that the config names (`setting`); failing is permanent."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as err:
        raise CannotServe(f"{setting}: cannot bind {endpoint} ({zmq.strerror(err.errno)}){_taken(err.errno)}: "
                          f"change {setting}") from None


def _tcp_socket(endpoint: str) -> tuple[socket.socket, tuple]:
    """A TCP socket (SO_REUSEADDR set) for tcp://HOST:PORT, and the address to bind it to; HOST `*` is
    every IPv4 address, [v6] an IPv6 one. OSError if HOST does not resolve."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = "0.0.0.0" if host == "*" else host.strip("[]")
    family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock, address


def bind_shared(sock: zmq.Socket, endpoint: str, setting: str) -> None:
    """Bind a ZeroMQ socket to a tcp:// endpoint that other processes of this server bind too: a
    listening socket with SO_REUSEPORT, handed to ZeroMQ (ZMQ_USE_FD), so that the kernel spreads new
    connections over the processes. Only processes of this user can join it (Linux's rule);
    failing is permanent."""
    try:
        listener, address = _tcp_socket(endpoint)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listener.bind(address)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
    except OSError as err:
        raise CannotServe(f"{setting}: cannot listen on {endpoint} ({err.strerror or err}){_taken(err.errno)}: "
                          f"change {setting}") from None
    sock.setsockopt(zmq.USE_FD, listener.detach())   # (ZeroMQ owns the descriptor now, and closes it)
    bind_endpoint(sock, endpoint, setting)


def port_free(endpoint: str) -> bool:
    """No process holds a tcp:// endpoint's port, shared or not (a server whose processes share it
    checks this before they bind: SO_REUSEPORT would let them join another server of this user)."""
    try:
        probe, address = _tcp_socket(endpoint)
        with probe:
            probe.bind(address)
    except OSError as err:
        return err.errno != errno.EADDRINUSE
    return True


def listen_tcp(host: str, port: int, setting: str, fix: str = "") -> list[socket.socket]:
    """Listening TCP sockets on host:port (one per address `host` resolves to, as asyncio's
    create_server binds), bound now so that a taken port ends the start, whenever they are served;
    failing is permanent. `fix` adds to the message, e.g. "(0: none)"."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise CannotServe(f"{setting}: cannot listen on {host}:{port} ({err.strerror or err}){_taken(err.errno)}: "
                          f"change {setting}{' ' + fix if fix else ''}") from None
    return sockets


class Actor(Protocol):
    device: str

    def run(self) -> None: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...


def tune_malloc() -> None:
    """Keep freed large buffers in the heap (glibc mallopt). Frames (2.7 MB at 720p) live until ZeroMQ
    has sent them; by default glibc returns each to the kernel and the next one faults its pages in
    again, which doubled the cost of a raw frame (docs/benchmarks.md)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024 * 1024)
    libc.mallopt(m_trim_threshold, 512 * 1024 * 1024)


def release_freed_memory() -> None:
    """Give the heap's free pages back to the kernel now (glibc malloc_trim), which tune_malloc's
    threshold otherwise keeps: after a rare large event (a model's load: its file's bytes, the session's
    construction), so the process's resident memory says what it holds. Elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


def set_process_title(title: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(title[:15])
    except OSError:
        pass


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG, as SGLang does for its
    workers): an orphan would keep the port and the shared memory of a supervisor killed with -9."""
    if not parent_pid:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux/glibc: the parent check below still runs once
        pass
    # NOTE: the parent may have died before prctl took effect: then nobody will ever signal us.
    if os.getppid() != parent_pid:
        os._exit(1)


def child_main(role: str, index: int, run: RunSpec, build: Callable[[zmq.Context], Actor]) -> None:
    die_with_parent(run.supervisor_pid)
    set_process_title(f"lsync-{role}{index}")
    tune_malloc()
    logging.basicConfig(level=os.environ.get("LIPSYNC_LOG", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s {role}{index} %(levelname)s %(message)s")
    faulthandler.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    # NOTE: a context of its own, so that a dying child can wait for its Fatal report to leave
    # (report_ctx.term()) without waiting on the sockets of a half-built actor.
    report_ctx = zmq.Context()
    supervisor = make_socket(report_ctx, zmq.PUSH, connect=run.endpoints.supervisor)
    actor = None
    try:
        actor = build(ctx)
        signal.signal(signal.SIGTERM, lambda *_: actor.stop())
        supervisor.send(pack(Ready(role=role, index=index, pid=os.getpid(), device=actor.device,
                                   state=getattr(actor, "ready_state", ProcState.READY),
                                   first_req=getattr(actor, "first_req", 0))))
        actor.run()
    except BaseException as err:
        if not isinstance(err, (KeyboardInterrupt, SystemExit)):
            permanent = bool(getattr(err, "permanent", False))
            if permanent:   # the message says what to change; a traceback would bury it
                message = str(err)
                logging.getLogger(role).error("%s", message)
            else:
                message = "".join(traceback.format_exception_only(type(err), err)).strip()
                logging.getLogger(role).error("%s", traceback.format_exc())
            supervisor.send(pack(Fatal(role=role, index=index, pid=os.getpid(), message=message)))
            supervisor.close(linger=1000)
            report_ctx.term()   # NOTE: returns once the report has left (or after the linger)
            # NOTE: exit now: sockets a half-built actor opened (e.g. through an asyncio shadow context)
            # are unknown to ctx.destroy(), whose term() would then wait for them forever.
            logging.shutdown()
            os._exit(EXIT_PERMANENT if permanent else 1)
        raise
    finally:
        if actor is not None:
            actor.close()
        ctx.destroy(linger=0)
        report_ctx.destroy(linger=0)
