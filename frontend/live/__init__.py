"""frontend/live/: live sessions. timeline.py (each session's frames, no sockets), service.py (the
session ops, the pacer, idle frames), speech.py (speech batching), h264_stream.py and h264_sessions.py
(H.264 sessions), capacity.py (when the host is full), viewer.py and static/ (the WebRTC viewer). It reaches the process hosting it only through
`Host` (host.py). Imports frontend/core/ and the shared modules, never server/, bridge/ or client/;
aiortc is imported by viewer.py alone.
"""
