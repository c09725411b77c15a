"""supervisor/ owns the process tree: `python -m supervisor` creates every shared-memory segment,
spawns the frontend, inference workers and compositing pool, restarts the dead, shuts down cleanly,
and builds the demo avatar of the embedded default.

May import every room; no room imports it.
"""
