"""cpu_actor/ owns compositing: the pool of processes that paste mouths into background frames with
SyncTalk_2D's exact math and encode them (JPEG, PNG, raw).

May import: shm, config. Never gpu_actor, frontend or supervisor.
"""
