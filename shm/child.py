"""The common life of every child process: title, log prefix, faulthandler, READY, death report.

Each role's entry is `run_<role>_process(config, run, index)`, which calls `child_main` with a
builder for its actor. The actor reports READY only once built (sockets bound, shm attached);
an exception is reported to the supervisor (in-band death) before the process exits non-zero.
SIGINT is ignored (the supervisor owns Ctrl-C); SIGTERM asks the actor to stop.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import traceback
from typing import Callable, Protocol

import zmq

from shm.endpoints import RunSpec, make_socket
from shm.codes import ProcState
from shm.messages import Fatal, Ready, encode


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
    supervisor = make_socket(ctx, zmq.PUSH, connect=run.endpoints.supervisor)
    actor = None
    try:
        actor = build(ctx)
        signal.signal(signal.SIGTERM, lambda *_: actor.stop())
        supervisor.send(encode(Ready(role=role, index=index, pid=os.getpid(), device=actor.device,
                                     state=getattr(actor, "ready_state", ProcState.READY))))
        actor.run()
    except BaseException as err:
        if not isinstance(err, (KeyboardInterrupt, SystemExit)):
            message = "".join(traceback.format_exception_only(type(err), err)).strip()
            logging.getLogger(role).error("%s", traceback.format_exc())
            supervisor.send(encode(Fatal(role=role, index=index, pid=os.getpid(), message=message)))
            supervisor.close(linger=1000)  # NOTE: give the Fatal report time to leave
            # NOTE: exit now: sockets a half-built actor opened (e.g. through an asyncio shadow context)
            # are unknown to ctx.destroy(), whose term() would then wait for them forever.
            logging.shutdown()
            os._exit(1)
        raise
    finally:
        if actor is not None:
            actor.close()
        ctx.destroy(linger=0)
