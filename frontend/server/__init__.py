"""frontend/server/: the client-facing process (`python -m supervisor` starts it): ZeroMQ ROUTER sockets,
validation of every request, the model catalog, the control ops' replies, and the replies themselves.
It is a core `Shell` and hosts live sessions (frontend/live/) through their `Host` interface.
"""
