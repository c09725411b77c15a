"""frontend/ owns the clients: the wire protocol (protocol.py), the asyncio ZeroMQ server that
validates, routes and answers every request, the metrics endpoint, and the Python client.

May import: shm, config. Never gpu_actor, cpu_actor or supervisor.
"""
