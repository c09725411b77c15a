"""HTTP on `metrics.port`: /metrics (Prometheus), /healthz (the process is alive) and /readyz (it would
serve a request now), the way Triton and KServe expose v2/health/live and v2/health/ready, for
Kubernetes probes and load balancers. A small threaded server: probes never wait on the event loop.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def serve(host: str, port: int, ready: Callable[[], Optional[str]],
          registry: Optional[CollectorRegistry] = None) -> Optional[ThreadingHTTPServer]:
    """Start serving in a daemon thread (port 0: not at all). `ready()` returns None when the process
    would serve a request now, else the reason it would not."""
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
                reason = ready()
                body = {"status": "ready"} if reason is None else {"status": "not ready", "reason": reason}
                self._reply(200 if reason is None else 503, (json.dumps(body) + "\n").encode(), "application/json")
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

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server
