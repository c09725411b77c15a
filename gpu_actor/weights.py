"""A model's weights in one buffer on its device: each tensor a view at an aligned offset, in its
architecture's order (gpu_actor/model_split.Architecture).

One allocation per model, not one per tensor (unet_328 has 186): the device memory a model holds is its
weight bytes plus at most ALIGN per tensor, and one copy moves all of them. With CUDA graphs
(`inference.cuda_graphs`) a prepared architecture binds one such buffer, its slot, at fixed addresses
(a graph replays the addresses it captured), and a call copies the model's buffer into the slot when
the slot holds another model's (48 MB device to device: tens of microseconds on an H100).
"""

from __future__ import annotations

from typing import Any

import numpy as np

ALIGN = 256   # bytes: what cudaMalloc gives each allocation, so every kernel's vector loads stay aligned


def layout(shapes: tuple[tuple[int, ...], ...], dtypes: tuple[np.dtype, ...]) -> tuple[list[int], int]:
    """Each tensor's byte offset, ALIGN-aligned, and the buffer's size."""
    offsets, total = [], 0
    for shape, dtype in zip(shapes, dtypes):
        offsets.append(total)
        total += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
    return offsets, max(total, ALIGN)


class Weights:
    """A buffer on `device` sized for `architecture`'s weights; `views` are its tensors."""

    def __init__(self, device, architecture, arrays: list[np.ndarray] | None = None):
        offsets, total = layout(architecture.shapes, architecture.dtypes)
        self.device, self.nbytes = device, total
        device.account(self, total)
        self.flat: Any = device.empty((total,), np.uint8)
        self.views: list = [self.flat[o:o + int(np.prod(s)) * np.dtype(d).itemsize].view(d).reshape(s)
                            for o, s, d in zip(offsets, architecture.shapes, architecture.dtypes)]
        for view, array in zip(self.views, arrays or ()):
            device.upload(view, np.require(array, requirements="C"))   # (0-d stays 0-d)
        if arrays:
            device.synchronize()   # NOTE: uploaded before the first call on another stream reads them

    def copy_from(self, other: "Weights") -> None:
        self.device.copy(self.flat, other.flat)
