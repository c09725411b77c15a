"""What the frontend knows of each model without loading it: audio shape, frame count and size.

Read from the files (ONNX input shapes, frame list, first frame) on first use, in a thread so the
event loop never blocks on disk, and cached; a failure is cached briefly so a fixed model directory
is picked up again without a restart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Optional

from config import Config
from config.assets import AssetError, list_model_ids, load_assets, max_frame_size, model_paths
from frontend.onnx_io import read_model_io

ERROR_TTL_S = 5.0


@dataclass(frozen=True)
class ModelSpec:
    id: str
    audio_shape: tuple[int, ...]
    frames: int
    width: int
    height: int
    order: str = "mirror"
    version: int = 0       # token of the background files read (config.assets.files_version)


@dataclass(frozen=True)
class CatalogError:
    code: str                  # unknown_model | bad_request
    message: str
    at: float


class Catalog:
    def __init__(self, config: Config):
        self.config = config
        self._specs: dict[str, ModelSpec | CatalogError] = {}
        self._inflight: dict[str, asyncio.Future] = {}

    def ids(self) -> list[str]:
        return list_model_ids(self.config)

    async def get(self, model_id: str) -> ModelSpec | CatalogError:
        cached = self._specs.get(model_id)
        if isinstance(cached, ModelSpec):
            return cached
        if isinstance(cached, CatalogError) and time.monotonic() - cached.at < ERROR_TTL_S:
            return cached
        future = self._inflight.get(model_id)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._inflight[model_id] = loop.run_in_executor(None, self._read, model_id)
            future.add_done_callback(lambda _: self._inflight.pop(model_id, None))
        spec = await asyncio.shield(future)
        self._specs[model_id] = spec
        return spec

    def _read(self, model_id: str) -> ModelSpec | CatalogError:
        paths = model_paths(self.config, model_id)
        if paths is None:
            return CatalogError("unknown_model", f"unknown model {model_id!r}: no such entry in `models` and no "
                                "such directory in `models_dir` (op `models` lists them)", time.monotonic())
        try:
            io = read_model_io(paths.onnx)
            assets = load_assets(paths, max_frame_size(self.config))
        except AssetError as err:
            code = "unknown_model" if "missing" in str(err) else "bad_request"
            return CatalogError(code, f"model {model_id}: {err}", time.monotonic())
        limit = self.config.limits.max_audio_elements
        if io.audio_elements > limit:
            return CatalogError("bad_request", f"model {model_id}: its audio window {list(io.audio_shape)} has "
                                f"{io.audio_elements} elements, more than limits.max_audio_elements ({limit}); "
                                "raise it", time.monotonic())
        return ModelSpec(model_id, io.audio_shape, assets.n_frames, assets.width, assets.height, assets.order,
                         assets.version)

    def forget(self, model_id: str) -> None:
        """Read the model's files again on next use (`unload` calls this: it is how replaced files are
        taken up without a restart)."""
        self._specs.pop(model_id, None)

    def known(self, model_id: str) -> Optional[ModelSpec]:
        spec = self._specs.get(model_id)
        return spec if isinstance(spec, ModelSpec) else None
