"""Prometheus metrics, served by the frontend on `metrics.port` (0 disables).

Everything is counted in the frontend from the messages it already receives (timings in InferDone and
CompositeDone, ModelEvents, ProcessEvents), so worker processes need no metrics endpoint of their own.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_MS = (1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120, 10240)


class Metrics:
    def __init__(self) -> None:
        self._children: dict[tuple, object] = {}   # (metric, label values) -> its child (`of`)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lipsync_requests", "Requests by op, model and outcome (ok or error code)",
                                ["op", "model", "outcome"], registry=r)
        self.frames = Counter("lipsync_frames", "Frames served", ["model"], registry=r)
        self.latency = Histogram("lipsync_latency_ms", "Latency by stage (queue, inference, composite, total)",
                                 ["stage"], buckets=_MS, registry=r)
        self.queue_depth = Gauge("lipsync_queue_depth", "Requests queued or in flight per inference worker",
                                 ["worker"], registry=r)
        self.compositor_depth = Gauge("lipsync_compositor_depth", "Requests assigned to each compositing process "
                                      "and not ended", ["compositor"], registry=r)
        self.h264_sessions = Gauge("lipsync_h264_sessions", "H.264 sessions (opening or open) per compositing "
                                   "process, which holds their encoders", ["compositor"], registry=r)
        self.models_loaded = Gauge("lipsync_models_loaded", "Models loaded per inference worker", ["worker"],
                                   registry=r)
        self.model_events = Counter("lipsync_model_events", "Model loads, unloads, evictions and failures",
                                    ["event"], registry=r)
        self.load_ms = Histogram("lipsync_model_load_ms", "Model load latency", buckets=_MS, registry=r)
        self.store = Counter("lipsync_background_cache", "Background store lookups by model and result",
                             ["model", "result"], registry=r)
        self.slots_in_use = Gauge("lipsync_shm_slots_in_use", "Input shm slots (one frame's room each) in use per inference worker",
                                  ["worker"], registry=r)
        self.device_steps = Counter("lipsync_device_steps", "A GPU worker's device steps by kind: one_model (one "
                                    "avatar's frames), sub_calls (several avatars, a call each), grouped (several "
                                    "avatars in one call of the architecture's N-model form)", ["worker", "kind"],
                                    registry=r)
        self.device_call_frames = Histogram("lipsync_device_call_frames", "Frames one device call of a GPU worker "
                                            "held (the rest of its prepared size: padding)", ["worker"],
                                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.device_call_rows = Counter("lipsync_device_call_rows", "Rows of a GPU worker's device calls: frame "
                                        "(a request's) or padding (up to the prepared size)", ["worker", "row"],
                                        registry=r)
        self.device_busy_s = Counter("lipsync_device_busy_seconds", "Seconds a GPU worker's device thread spent "
                                     "running steps (against the wall clock: how busy its device was kept)",
                                     ["worker"], registry=r)
        self.device_frames_per_s = Gauge("lipsync_device_frames_per_s", "The frames a second a GPU worker's "
                                         "steps run with the models it holds (measured per prepared size: with "
                                         "several avatars of an architecture, their steps' form); live admission "
                                         "holds sessions' speech within it", ["worker"], registry=r)
        self.restarts = Counter("lipsync_process_restarts", "Child process restarts", ["role"], registry=r)
        self.sessions_open = Gauge("lipsync_sessions_open", "Live sessions open", registry=r)
        self.sessions_refused = Counter("lipsync_sessions_refused", "session_opens answered busy: the server was "
                                        "full (sessions.max_sessions, max_cpu_load, max_process_load)", registry=r)
        self.cpu_load = Gauge("lipsync_cpu_load", "The server's processes' CPU over the last seconds, as a share of "
                              "the cores the host gives them (measured while sessions are admitted)", registry=r)
        self.sessions_shed = Gauge("lipsync_sessions_shed", "Live sessions whose speech is partly or wholly not "
                                   "rendered because the host is full, the newest first (sessions.shed_speech)",
                                   registry=r)
        self.session_frames = Counter("lipsync_session_frames", "Live session frames by kind: speech, idle; "
                                      "missed (idle where speech was due), dropped (client not reading), skipped, shed (not "
                                      "rendered: the host was full)",
                                      ["kind"], registry=r)
        self.session_lateness = BatchHistogram("lipsync_session_lateness_ms", "How long after its due time a live "
                                               "session frame was sent", (1, 2, 5, 10, 20, 40, 80, 160, 320), r)
        self.replies_dropped = Counter("lipsync_replies_dropped", "Replies dropped because their client did not "
                                       "read (limits.max_client_backlog_bytes)", registry=r)
        self.backlog_bytes = Gauge("lipsync_client_backlog_bytes", "Reply bytes clients have not read yet, all "
                                   "connections together", registry=r)

    def of(self, metric, *values: str):
        """`metric.labels(*values)`, looked up once: prometheus_client checks the values and takes a lock
        on every call, and requests count per message. (Label values are bounded: a model gets its own
        only once the catalog knows it, server/calls.Call.label.)"""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def count_request(self, op: str, model: str, outcome: str) -> None:
        """A request ended: `lipsync_requests` by op, model label and outcome (ok or an error code)."""
        self.of(self.requests, op, model, outcome).inc()

    def serve(self, host: str, port: int, ready) -> None:
        """/metrics, /healthz and /readyz on `port` (frontend/probes.py); 0 disables them."""
        from frontend.probes import serve
        serve(host, port, ready, self.registry)


class BatchHistogram:
    """A histogram observed many values at a time (a pacer tick's frames), exposed like prometheus_client's
    `Histogram` (_bucket, _count, _sum), without its lock and bucket search per value. Written on the
    event loop only; the metrics thread reads a copy (one list copy, atomic under the GIL)."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._bounds = tuple(float(b) for b in buckets)
        self._state: list = [0] * (len(self._bounds) + 1) + [0.0]   # per bucket (+Inf last), then the sum
        registry.register(self)

    def observe(self, values: Iterable[float]) -> None:
        state, bounds = self._state, self._bounds
        total = 0.0
        for value in values:
            state[bisect_left(bounds, value)] += 1   # (the first bucket whose bound is >= value)
            total += value
        state[-1] += total

    def collect(self):
        state = list(self._state)
        buckets, cumulative = [], 0
        for bound, n in zip((*self._bounds, float("inf")), state):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=state[-1])
