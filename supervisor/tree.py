"""The process tree: create shared memory, spawn every child, watch them, restart the dead, shut down.

The supervisor alone creates and unlinks shared memory (in `finally`, so also when start-up fails);
segments of dead runs are swept at start. Death is detected twice: a child reports its exception
(Fatal), and the supervisor polls every child's sentinel (SIGKILL, segfault). Either way the frontend
is told at once, and it answers every request the dead process held with `unavailable`.

A dead child is restarted, unless no restart can cure it: a child that exits EXIT_PERMANENT (a port
another program holds, an unreadable key file: shm/child.py `CannotServe`) ends the whole server at
once, and so does a role left with no process (each crashed supervisor.max_restarts times): the
supervisor stops every child, removes the shared memory and exits non-zero, for systemd or
Kubernetes to see, instead of staying up with nothing to serve.

The supervisor imports no actor: each child imports its own role's module (supervisor/entry.py).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import zmq

from config import Config, resolve_path
from config.geometry import MOUTH_BYTES, input_page_bytes, input_slot_bytes
from shm.board import Board
from shm.child import EXIT_PERMANENT, port_free
from shm.codes import ProcState
from shm.endpoints import Endpoints, Owners, RunSpec, make_socket
from shm.messages import Fatal, ProcessEvent, Ready, ResetRequests, pack, unpack
from shm.ring import RingSpec, SlotRing
from shm.segment import run_prefix, sweep_dead_runs
from shm.store import BackgroundStore, store_spec
from supervisor.entry import ENTRIES, mark, run_entry

log = logging.getLogger("supervisor")


def install_signal_handlers() -> threading.Event:
    """SIGINT/SIGTERM only set the returned flag (the loops poll it within 0.2 s): installed before any
    shared memory exists, so a signal at any point of start-up still ends in a clean shutdown."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


class StartError(RuntimeError):
    """A child did not come up; the message names it and the cause."""


class ServeError(RuntimeError):
    """The server cannot go on (a permanent error, or a role out of restarts); the message says why."""


@dataclass
class Child:
    role: str
    index: int
    process: Optional[mp.process.BaseProcess] = None
    state: ProcState = ProcState.STARTING
    restarts: int = 0
    crash_times: list[float] = field(default_factory=list)
    restart_at: float = 0.0
    last_error: str = ""
    ready_state: ProcState = ProcState.READY   # what a ready process says it is (VACANT: an empty DNS slot)

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


def resolve_devices(config: Config, role: str = "all") -> list[str]:
    """One entry per inference worker: 'cpu', 'cuda:N', or 'remote:<endpoint>' (a GPU host)."""
    remote = []
    for h in config.bridge.hosts if role != "gpu" else ():
        if h.endpoint:
            remote.append(f"remote:{h.endpoint}")
        else:
            from gpu_actor.discovery import dns_device   # NOTE: here: only GPU hosts found by DNS need it
            remote += [dns_device(h.dns, h.port, i) for i in range(h.max_hosts)]
    if role == "edge":
        if not remote:
            raise StartError("--role edge needs GPU hosts: list them in bridge.hosts")
        return remote
    return _local_devices(config) + remote


def _local_devices(config: Config) -> list[str]:
    from gpu_actor.device import cuda_provider, visible_gpus   # NOTE: here: onnxruntime only where asked
    inf = config.inference
    wanted = inf.devices
    if wanted == "cpu":
        gpus: list[int] = []
    elif wanted == "auto":
        gpus = visible_gpus()
    else:
        if not cuda_provider():
            raise StartError(f"inference.devices lists GPUs {list(wanted)} but onnxruntime has no CUDA provider "
                             "(install the gpu extra: LIPSYNC_EXTRAS=gpu), or set inference.devices: cpu")
        gpus = list(wanted)
    devices = [f"cuda:{g}" for g in gpus] or ["cpu"]
    return [d for d in devices for _ in range(inf.workers_per_device)]


def check_models_dir(config: Config) -> None:
    """models_dir must be a directory this user can list: a wrong path would otherwise serve no model,
    and no restart would cure it."""
    if config.models_dir is None:
        return
    path = resolve_path(config, config.models_dir)
    if not path.is_dir():
        raise StartError(f"models_dir: {path} is not a directory; set models_dir to the directory of model "
                         "directories (<models_dir>/<id>/model.onnx, frames/, crop_rects.json)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise StartError(f"models_dir: {path} cannot be read by this user (uid {os.getuid()}); fix its "
                         "permissions or set models_dir")


def client_facing(config: Config, role: str) -> tuple[int, list[tuple[str, str]]]:
    """How many client-facing processes the role runs (a GPU host's: its bridges), and the endpoints they
    bind, each with its setting's name."""
    if role == "gpu":
        return config.bridge.processes, [(config.bridge.bind, "bridge.bind")]
    return config.frontend.processes, [(e, "frontend.bind") for e in config.frontend.bind]


class Supervisor:
    def __init__(self, config: Config, role: str = "all", stop: Optional[threading.Event] = None):
        self.config, self.role = config, role
        # SIGINT/SIGTERM set it (install_signal_handlers), also during start-up.
        self.stop_requested = stop or threading.Event()
        if role == "gpu" and not config.bridge.secret_key and not config.bridge.insecure_plaintext:
            raise StartError("--role gpu needs bridge.secret_key and bridge.authorized_keys (`python -m supervisor "
                             "keys DIR NAME` writes key pairs), or bridge.insecure_plaintext: true for a trusted "
                             "network (docs/security.md)")
        n, binds = client_facing(config, role)
        # NOTE: the processes share each port (SO_REUSEPORT), which would let them join another server of this
        # user on it as well: a taken port ends the start here
        for endpoint, setting in binds if n > 1 else ():
            if not port_free(endpoint):
                raise StartError(f"{setting}: cannot listen on {endpoint} (Address already in use; another program "
                                 f"holds the port): change {setting}")
        self._created: list = []
        self.board: Optional[Board] = None
        self.run_dir = tempfile.mkdtemp(prefix="lsync-")
        try:
            self._create_shared_memory()
        except BaseException:
            self._cleanup()
            raise
        self.ctx = zmq.Context()
        self.inbox = make_socket(self.ctx, zmq.PULL, bind=self.run.endpoints.supervisor)
        self.to_frontend = Owners(self.ctx, self.run.endpoints.frontend)
        self.to_gpu = [make_socket(self.ctx, zmq.PUSH, connect=a) for a in self.run.endpoints.gpu]
        self.to_cpu = [make_socket(self.ctx, zmq.PUSH, connect=a) for a in self.run.endpoints.cpu]
        self.children = ([Child("gpu", i) for i in range(len(self.run.devices))]
                         + [Child("cpu", i) for i in range(len(self.run.endpoints.cpu))]
                         + [Child("bridge" if role == "gpu" else "frontend", i)
                            for i in range(len(self.run.endpoints.frontend))])
        self._mp = mp.get_context("spawn")

    # -- shared memory --------------------------------------------------------------------------

    def _create_shared_memory(self) -> None:
        cfg = self.config
        check_models_dir(cfg)
        swept = sweep_dead_runs(cfg.shm.prefix)
        if swept:
            log.warning("removed %d shared-memory segments of dead runs: %s", len(swept), ", ".join(swept[:5]))
        devices = resolve_devices(cfg, self.role)
        prefix = run_prefix(cfg.shm.prefix)
        lim = cfg.limits
        # NOTE: slots of one frame's room: a request takes as many as its frames need, so a worker holds
        # shm.slots requests of limits.max_batch frames in flight, or that many times more of one frame
        # each (a live session's), which its steps then run together.
        in_bytes = input_slot_bytes(lim.max_batch, lim.max_audio_elements)
        in_page = input_page_bytes(lim.max_audio_elements)
        n_front, _ = client_facing(cfg, self.role)
        inputs = tuple(RingSpec.in_pages(f"{prefix}-in{i}" + (f"f{f}" if f else ""), cfg.shm.slots, in_bytes, in_page)
                       for f in range(n_front) for i in range(len(devices)))
        outputs = tuple(RingSpec.in_pages(f"{prefix}-out{i}", cfg.shm.slots, lim.max_batch * MOUTH_BYTES, MOUTH_BYTES)
                        for i in range(len(devices)))
        # NOTE: created unpopulated, and populated once the children are spawned (_populate_rings): the
        # page faults (0.4 s for the default 540 MB) then run beside the children's start, not before it.
        for spec in inputs + outputs:
            self._created.append(SlotRing.create(spec, populate=False))
        self._unpopulated = inputs + outputs
        comp = cfg.compositing
        store = store_spec(prefix, self.run_dir, comp.cache_bytes, comp.max_frame_width, comp.max_frame_height,
                           comp.eviction)
        self._created.append(BackgroundStore.create(store))
        n_cpu = comp.resolved_workers() if self.role != "gpu" else 0
        # Raw frames are composited into these; sparse (not pre-faulted): only raw requests touch them.
        image_bytes = lim.max_batch * comp.max_frame_width * comp.max_frame_height * 3
        images = tuple(RingSpec.for_bytes(f"{prefix}-img{j}", cfg.shm.slots, image_bytes) for j in range(n_cpu))
        for spec in images:
            self._created.append(SlotRing.create(spec, populate=False))
        # the client-facing processes' sessions, for admission over the whole host (a GPU host's bridges
        # hold none)
        self.board = (Board.create(f"{prefix}-board", n_front, len(cfg.frontend.session_limits()))
                      if self.role != "gpu" else None)
        if self.board is not None:
            self._created.append(self.board)
        self.run = RunSpec(prefix, self.run_dir, Endpoints.in_dir(self.run_dir, len(devices), n_cpu, n_front),
                           inputs, outputs, store, tuple(devices), images, os.getpid(),
                           self.board.name if self.board is not None else "")

    def _cleanup(self) -> None:
        for obj in self._created:
            try:
                obj.close(unlink=True)
            except Exception:
                log.exception("could not remove a shared-memory segment")
        self._created.clear()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- children -------------------------------------------------------------------------------

    def _spawn(self, child: Child) -> None:
        remote = child.role == "gpu" and self.run.devices[child.index].startswith("remote:")
        entry = ENTRIES["remote" if remote else child.role]
        child.process = self._mp.Process(target=run_entry, args=(entry, self.config, self.run, child.index),
                                         name=f"lsync-{child.name}", daemon=False)
        child.process.start()
        mark(f"spawned:{child.name}:{child.process.pid}")
        child.state, child.last_error = ProcState.STARTING, ""
        self._event(child)

    def _event(self, child: Child) -> None:
        if child.role in ("frontend", "bridge"):
            return
        pid = child.process.pid if child.process is not None else None
        device = self.run.devices[child.index] if child.role == "gpu" else "cpu"
        state = child.ready_state if child.state is ProcState.READY else child.state
        self.to_frontend.broadcast(pack(ProcessEvent(role=child.role, index=child.index, pid=pid, state=state,
                                                restarts=child.restarts, device=device)))

    def start(self) -> None:
        """Spawn everything and wait for every READY; StartError names who failed and why."""
        for child in self.children:
            self._spawn(child)
        self._populate_rings()
        mark("populated")
        deadline = time.monotonic() + self.config.supervisor.start_timeout_s
        while any(c.state != ProcState.READY for c in self.children):
            if self.stop_requested.is_set():
                raise StartError("stopped by a signal during start-up")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = ", ".join(c.name for c in self.children if c.state != ProcState.READY)
                raise StartError(f"{late} did not report READY within supervisor.start_timeout_s "
                                 f"({self.config.supervisor.start_timeout_s:g}s); raise it if model loading is slow")
            self._poll(min(remaining, 0.5), starting=True)
        for child in self.children:
            self._event(child)  # the frontend came up last: tell it who is ready

    def _populate_rings(self) -> None:
        """Fault the slot rings' pages in (allocated once, pre-faulted), while the children import. A
        child that attaches a ring before this is done faults the rest in itself: either way no request
        pays for them."""
        for spec in self._unpopulated:
            if self.stop_requested.is_set():
                return
            SlotRing.attach(spec, populate=True).close()
        self._unpopulated = ()

    def _poll(self, timeout_s: float, starting: bool = False) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        for child in self.children:
            if child.process is not None and child.state in (ProcState.STARTING, ProcState.READY):
                poller.register(child.process.sentinel, zmq.POLLIN)
        poller.poll(int(timeout_s * 1000))
        while self.inbox.poll(0):
            self._on_message(unpack(self.inbox.recv()))
        for child in self.children:
            live = child.state in (ProcState.STARTING, ProcState.READY)
            if child.process is not None and live and not child.process.is_alive():
                self._on_death(child, starting)

    def _find(self, role: str, index: int) -> Child:
        return next(c for c in self.children if c.role == role and c.index == index)

    def _on_message(self, msg) -> None:
        if isinstance(msg, Ready):
            child = self._find(msg.role, msg.index)
            if child.process is None or child.process.pid != msg.pid:
                return
            child.state, child.ready_state = ProcState.READY, msg.state
            mark(f"ready:{child.name}", of=msg.pid)
            log.info("%s ready (pid %d)%s", child.name, msg.pid, "" if msg.state is ProcState.READY else
                     f", {msg.state.value}")
            if child.role in ("frontend", "bridge") and child.restarts:
                for sock in self.to_gpu + self.to_cpu:
                    sock.send(pack(ResetRequests(floor=msg.first_req)))
                for other in self.children:
                    self._event(other)
            self._event(child)
        elif isinstance(msg, Fatal):
            child = self._find(msg.role, msg.index)
            if child.process is not None and child.process.pid == msg.pid:
                child.last_error = msg.message

    def _await_report(self, child: Child, wait_s: float = 1.0) -> None:
        """A child that died of an exception sent its Fatal report first, but the sentinel can be seen
        before the report is read: wait a moment for it, for the message it carries."""
        deadline = time.monotonic() + wait_s
        while not child.last_error and self.inbox.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
            self._on_message(unpack(self.inbox.recv()))

    def _on_death(self, child: Child, starting: bool) -> None:
        child.process.join(1)
        code = child.process.exitcode
        if code and code > 0:
            self._await_report(child)
        why = child.last_error or (f"killed by signal {-code}" if code and code < 0 else f"exit code {code}")
        if starting:
            raise StartError(f"{child.name} died during start-up: {why}")
        if code == EXIT_PERMANENT:   # no restart can cure it (shm/child.py CannotServe): end the server now
            child.state = ProcState.FAILED
            raise ServeError(f"{child.name} died of an error that no restart can cure: {why}")
        log.error("%s (pid %d) died: %s", child.name, child.process.pid, why)
        if child.role == "frontend" and self.board is not None:
            self.board.vacate(child.index)
        now = time.monotonic()
        window = self.config.supervisor.restart_window_s
        child.crash_times = [t for t in child.crash_times if now - t < window] + [now]
        child.last_error = ""
        if len(child.crash_times) > self.config.supervisor.max_restarts:
            child.state = ProcState.FAILED
            log.error("%s crashed %d times within %gs (supervisor.max_restarts): not restarting it",
                      child.name, len(child.crash_times), window)
            peers = [c for c in self.children if c.role == child.role]
            if all(c.state is ProcState.FAILED for c in peers):
                # NOTE: a role with a process left still serves (health: degraded); one with none left
                # cannot, and only a restart of the whole server (systemd, Kubernetes) may cure it.
                raise ServeError(f"every {child.role} process crashed more than supervisor.max_restarts "
                                 f"({self.config.supervisor.max_restarts}) times within supervisor.restart_window_s "
                                 f"({window:g}s); the last: {child.name}: {why}")
        else:
            child.state = ProcState.RESTARTING
            backoff = self.config.supervisor.restart_backoff_s * 2 ** (len(child.crash_times) - 1)
            child.restart_at = now + min(backoff, 30.0)
        self._event(child)

    def serve(self) -> int:
        """Watch the children until SIGINT/SIGTERM (exit status 0); restart the dead ones. 1: the server
        cannot go on (a permanent error, or a role with no process left); the caller shuts down."""
        try:
            while not self.stop_requested.is_set():
                self._poll(0.2)
                now = time.monotonic()
                for child in self.children:
                    if child.state == ProcState.RESTARTING and now >= child.restart_at:
                        child.restarts += 1
                        log.info("restarting %s (restart %d)", child.name, child.restarts)
                        self._spawn(child)
        except ServeError as err:   # systemd, Kubernetes: a non-zero exit, to restart or report the server
            log.error("cannot go on serving: %s", err)
            return 1
        return 0

    def shutdown(self) -> None:
        """Stop accepting and drain (the frontend first), stop the children, unlink shared memory."""
        grace = self.config.supervisor.shutdown_timeout_s
        log.info("shutting down: finishing requests in flight (up to %gs)", grace)
        front = ("frontend", "bridge")
        order = [[c for c in self.children if c.role in front], [c for c in self.children if c.role not in front]]
        for group in order:
            live = [c for c in group if c.process is not None and c.process.is_alive()]
            for child in live:
                child.state = ProcState.STOPPED
                os.kill(child.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace + 2
            for child in live:
                child.process.join(max(0.0, deadline - time.monotonic()))
                if child.process.is_alive():
                    log.warning("%s did not stop in time; killing it", child.name)
                    child.process.kill()
                    child.process.join(5)
        self.ctx.destroy(linger=0)
        self._cleanup()
        log.info("stopped; shared memory removed")

    def warnings(self) -> list[str]:
        cfg, out = self.config, []
        if self.role != "gpu" and cfg.frontend.curve is None:
            exposed = [e for e in cfg.frontend.bind if e.startswith("tcp://") and not
                       any(h in e for h in ("://127.", "://localhost", "://[::1]"))]
            if exposed:
                out.append(f"frontend.bind {exposed} is not loopback and frontend.curve is off: any client that "
                           "reaches it can use every model (docs/security.md)")
        if self.role == "gpu" and not cfg.bridge.secret_key:
            out.append("bridge.insecure_plaintext: the bridge is plaintext and accepts any edge (docs/security.md)")
        if self.role != "gpu" and cfg.bridge.hosts and not cfg.bridge.client_secret_key:
            out.append("bridge.insecure_plaintext: the bridge to the GPU hosts is plaintext (docs/security.md)")
        return out

    def summary(self) -> str:
        cfg = self.config
        workers = ", ".join(f"gpu{i}={d}" for i, d in enumerate(self.run.devices))
        metrics = f"http://{cfg.metrics.host}:{cfg.metrics.port}/metrics" if cfg.metrics.port else "disabled"
        from config.assets import list_model_ids
        ids = list_model_ids(cfg)
        shown = ", ".join(ids[:5]) + (f", ... ({len(ids)} in all)" if len(ids) > 5 else "")
        where = cfg.bridge.bind + " (bridge, for edges)" if self.role == "gpu" else ", ".join(cfg.frontend.bind)
        n = len(self.run.endpoints.frontend)
        if n > 1:
            where += f" ({n} {'bridge' if self.role == 'gpu' else 'client-facing'} processes)"
        return (f"role {self.role}: serving on {where}\n"
                f"  inference workers: {workers}\n"
                f"  compositing processes: {len(self.run.endpoints.cpu)}\n"
                f"  models: {shown or 'none'}\n"
                f"  metrics: {metrics}")
