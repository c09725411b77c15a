"""gpu_actor/ owns inference: one process per GPU worker (or CPU provider), the multi-tenant model
registry, the unet_328-shaped model builder, and the CUDA path (IO binding, cupy).

May import: shm, config. Never cpu_actor, frontend or supervisor.
"""
