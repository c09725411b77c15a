"""frontend/ owns everything that speaks to clients and edges, in sub-rooms, one per process or concern:

- core/    the IO-free request engine (requests, scheduler, backlogs) and `Shell`, the one apply and
           drain loop both process shells run. Imports nothing else of frontend/.
- server/  the client-facing process: sockets, intake and validation, the catalog, control ops, replies.
- live/    live sessions (timelines, speech batching, the pacer, H.264, the WebRTC viewer), hosted by
           the server through a small `Host` interface. Imports core/ and the shared modules only.
- bridge/  the GPU host's process: edges' requests into the same engine. Imports core/ and the shared modules.
- client/  the Python SDK and `python -m frontend.client`. Imports the wire protocol only.
Shared by them: protocol.py (the wire), metrics.py (Prometheus), probes.py (/healthz, /readyz: one rule).

May import: shm, config. Never gpu_actor, cpu_actor or supervisor. tests/test_layout.py holds the rules.
"""
