"""gpu_actor/ owns inference: one process per GPU worker (or CPU provider), the multi-tenant model
registry, the devices (CPU, CUDA, the stand-in that runs the GPU path on the CPU) and how their
onnxruntime sessions are made, the two loaders (a session per model; prepared architectures with each
model's weights bound per call, CUDA graphs, the grouped N-model form), the audio encoders, the
unet_328-shaped model builder, and the edge's end of the bridge (remote.py).

May import: shm, config. Never cpu_actor, frontend or supervisor.
"""
