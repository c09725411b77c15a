"""frontend/server/: the client-facing process (`python -m supervisor` starts it), by concern: its
sockets and loops (process.py, a core `Shell` that hosts live sessions through their `Host` interface),
client requests in (intake.py, validate.py, catalog.py), a client's request and how it ends (calls.py,
control.py), and replies out (replies.py).
"""
