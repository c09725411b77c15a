"""supervisor/ owns the process tree: `python -m supervisor` creates every shared-memory segment,
spawns the frontend, inference workers and compositing pool, restarts the dead, shuts down cleanly,
and builds the demo avatar of the embedded default. `python -m supervisor import-synctalk2d` (importer/)
turns a trained SyncTalk_2D avatar into a model directory.

May import every room; no room imports it.
"""
