"""What the frontend knows of each model without loading it: audio shape, frame count and size.

Read from the files (ONNX input shapes, frame list, first frame's header) on first use, in a thread so
the event loop never blocks on disk, and cached; a failure is cached briefly so a fixed model directory
is picked up again without a restart. Failures are kept for at most MAX_ERRORS ids (a client sending
random ids must not grow them without bound).

Two paths, so that a bulk read never queues in front of a request: a request's model is read on the
event loop's executor at once; the whole catalog (at start, and the models `models` finds unread) is
read by one background thread, and `models` answers at once with what is known so far.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from config import Config
from config.assets import AssetError, list_model_ids, load_assets, max_frame_size, model_paths
from frontend.server.onnx_io import read_model_io

ERROR_TTL_S = 5.0
MAX_ERRORS = 1024


@dataclass(frozen=True)
class ModelSpec:
    id: str
    audio_shape: tuple[int, ...]
    frames: int
    width: int
    height: int
    order: str = "mirror"
    version: int = 0       # token of the background files read (config.assets.files_version)
    encoder: bool = False  # an audio encoder is configured: 16 kHz PCM input is possible


@dataclass(frozen=True)
class CatalogError:
    code: str                  # unknown_model | bad_request
    message: str
    at: float


class Catalog:
    def __init__(self, config: Config):
        self.config = config
        self._specs: dict[str, ModelSpec] = {}
        self._errors: OrderedDict[str, CatalogError] = OrderedDict()
        self._inflight: dict[str, asyncio.Future] = {}
        self._warmer = cf.ThreadPoolExecutor(1, thread_name_prefix="catalog")
        self._warming: set[str] = set()

    def close(self) -> None:
        self._warmer.shutdown(wait=False, cancel_futures=True)

    def warm(self, ids: list[str]) -> None:
        """Read the specs of `ids` not known yet, one after another on the background thread."""
        todo = [i for i in ids if self.known(i) is None and i not in self._warming and i not in self._inflight]
        if not todo:
            return
        self._warming.update(todo)
        loop = asyncio.get_running_loop()

        def read_all() -> None:
            for model_id in todo:
                spec = self._read(model_id)
                loop.call_soon_threadsafe(self._warmed, model_id, spec)

        self._warmer.submit(read_all)

    def _warmed(self, model_id: str, spec: ModelSpec | CatalogError) -> None:
        self._warming.discard(model_id)
        if model_id not in self._inflight:
            self._store(model_id, spec)

    async def ids(self) -> list[str]:
        """Every model id (a directory listing: off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(None, list_model_ids, self.config)

    async def get(self, model_id: str) -> ModelSpec | CatalogError:
        cached = self._specs.get(model_id)
        if cached is not None:
            return cached
        error = self.error(model_id)
        if error is not None:
            return error
        future = self._inflight.get(model_id)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._inflight[model_id] = loop.run_in_executor(None, self._read, model_id)
            future.add_done_callback(lambda f: self._keep(model_id, f))
        return await asyncio.shield(future)

    def _keep(self, model_id: str, future: asyncio.Future) -> None:
        self._inflight.pop(model_id, None)
        if not future.cancelled():
            self._store(model_id, future.result())

    def _store(self, model_id: str, spec: ModelSpec | CatalogError) -> None:
        if isinstance(spec, ModelSpec):
            self._specs[model_id] = spec
            self._errors.pop(model_id, None)
            return
        self._errors[model_id] = spec
        self._errors.move_to_end(model_id)
        while len(self._errors) > MAX_ERRORS:
            self._errors.popitem(last=False)

    def error(self, model_id: str) -> Optional[CatalogError]:
        """The cached failure of reading `model_id`, while it is fresh."""
        error = self._errors.get(model_id)
        return error if error is not None and time.monotonic() - error.at < ERROR_TTL_S else None

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
                         assets.version, paths.audio_encoder is not None)

    def forget(self, model_id: str) -> None:
        """Read the model's files again on next use (`unload` calls this: it is how replaced files are
        taken up without a restart)."""
        self._specs.pop(model_id, None)
        self._errors.pop(model_id, None)

    def known(self, model_id: str) -> Optional[ModelSpec | CatalogError]:
        """What is known of `model_id` without reading anything: its spec, a fresh failure, or None."""
        return self._specs.get(model_id) or self.error(model_id)
