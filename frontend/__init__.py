"""frontend/ owns everything that speaks to clients and edges, in sub-rooms, one per process or concern:

- core/    the IO-free request engine (requests, scheduler, backlogs) and `Shell`, the one apply and
           drain loop both process shells run. Imports nothing else of frontend/.
- server/  the client-facing process: sockets, intake and validation, the catalog, control ops, replies.
- live/    live sessions (timelines, speech batching, the pacer, H.264, the WebRTC viewer), hosted by
           the server through a small `Host` interface. Imports core/ and the shared modules only.
- bridge/  the GPU host's process: edges' requests into the same engine. Imports core/ and the shared modules.
Shared by them: metrics.py (Prometheus), probes.py (/healthz, /readyz: one rule). The wire protocol is
the client distribution's (lipsync_client.protocol, client/), which clients install without the server.

May import: shm, config, and of lipsync_client its protocol and contract only. Never gpu_actor, cpu_actor
or supervisor. tests/test_layout.py holds the rules.
"""
