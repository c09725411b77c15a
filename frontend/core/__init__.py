"""frontend/core/: every request's life with no sockets: `Request` and `Inputs` (request.py), the
`Scheduler` (routing, slots, queues, plans, gathering, deadlines, deaths), per-connection backlogs,
one timer for many deadlines, writing inputs into a worker's slot, and `Shell`: how a process carries
out the engine's actions and drains. Imports nothing else of frontend/.
"""
