"""gpu_actor/ owns inference: one process per GPU worker (or CPU provider), the multi-tenant model
registry, the devices (CPU, CUDA, the stand-in that runs the GPU path on the CPU) and how their
onnxruntime sessions are made, the GPU path's prepared batch sizes and shared architectures, the audio
encoders, the unet_328-shaped model builder, an architecture's grouped form (n models' weights
in one call).

May import: shm, config. Never cpu_actor, frontend or supervisor.
"""
