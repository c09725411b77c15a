"""HTTP on `metrics.port`: /metrics (Prometheus), /healthz (the process is alive) and /readyz (it would
serve a request now), the way Triton and KServe expose v2/health/live and v2/health/ready, for
Kubernetes probes and load balancers. A small threaded server: probes never wait on the event loop.
"""

from __future__ import annotations

import errno
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shm.child import CannotServe
from shm.codes import ProcState

SERVING = ("ready", "degraded")   # /readyz answers 200 for these, 503 for starting, draining, not ready


def readiness(workers: list, compositors: list, synced: bool, draining: bool) -> tuple[str, Optional[str]]:
    """(status, reason) of a process that serves with `workers` (and `compositors`, which a GPU host
    has none of): ready; degraded (it serves, but a process is down); starting (no state yet, or a
    process still in its first start); draining (SIGTERM: finishing what is in flight, taking nothing
    new); not ready. Vacant GPU-host slots (DNS discovery) are neither down nor ready."""
    if draining:
        return "draining", "shutting down: finishing the requests in flight, taking no new ones"
    workers = [w for w in workers if w.state is not ProcState.VACANT]
    # NOTE: a process in its first start is not "down": until each one has come up once the server
    # is starting (not degraded), whichever came up first.
    first_start = [p for p in [*workers, *compositors] if p.state is ProcState.STARTING and not p.restarts]
    if not synced or not workers or first_start:
        return "starting", ("the inference workers are starting" if any(w in first_start for w in workers)
                            else "the compositing processes are starting" if first_start else
                            "no GPU host found yet" if not workers else "waiting for the processes' state")
    if not any(w.ready for w in workers):
        return "not ready", "no inference worker is ready: " + ", ".join(f"{w.device} {w.state.value}" for w in workers)
    if compositors and not any(c.ready for c in compositors):
        return "not ready", "no compositing process is ready"
    down = [f"{w.device} {w.state.value}" for w in workers if not w.ready]
    down += [f"compositing process {i} {c.state.value}" for i, c in enumerate(compositors) if not c.ready]
    return ("degraded", ", ".join(down)) if down else ("ready", None)


def serve(host: str, port: int, ready: Callable[[], tuple[str, Optional[str]]],
          registry: Optional[CollectorRegistry] = None) -> Optional[ThreadingHTTPServer]:
    """Start serving in a daemon thread (port 0: not at all). `ready()` returns `readiness(...)`.
    A port that cannot be bound raises CannotServe, naming metrics.port."""
    if not port:
        return None

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:   # noqa: N802 (http.server's name)
            path = self.path.split("?")[0]
            if path == "/metrics" and registry is not None:
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._reply(200, b'{"status": "alive"}\n', "application/json")
            elif path == "/readyz":
                status, reason = ready()
                body = {"status": status} if reason is None else {"status": status, "reason": reason}
                self._reply(200 if status in SERVING else 503, (json.dumps(body) + "\n").encode(), "application/json")
            else:
                self._reply(404, b'{"error": "not found: /metrics, /healthz or /readyz"}\n', "application/json")

        def _reply(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:   # probes every few seconds must not flood the log
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as err:   # a taken port stays taken: no restart can cure it
        taken = "; another program holds it" if err.errno == errno.EADDRINUSE else ""
        raise CannotServe(f"metrics.port: cannot listen on {host}:{port} ({err.strerror or err}){taken}: change "
                          "metrics.port (0: no /metrics, /healthz, /readyz)") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server
