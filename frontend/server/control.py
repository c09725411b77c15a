"""The control ops' replies: health and models (answered by the frontend alone), and load, unload and
stats (gathered from the inference workers by the engine; stats after at most the engine's
stats_timeout_s with whatever came)."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any

from lipsync_client import protocol as P
from frontend.core.request import Kind, Request
from frontend.core.scheduler import merge_model_stats
from frontend.server.catalog import CatalogError
from shm.codes import ProcState

Frontend = Any   # the server process (server/process.py), which calls these with itself
Call = Any       # server/calls.py's Call (which calls `reply` to answer itself)

MODELS_WAIT_S = 0.25
MODELS_WAIT_FOR = 64


@functools.cache
def _version() -> str:
    """The installed package's version: read once (health is polled, and each read opens METADATA)."""
    try:
        from importlib.metadata import version
        return version("lipsync-serve")
    except Exception:
        return "0.0.0"


def health(fe: Frontend, call: Call) -> bytes:
    engine = fe.engine
    procs = [P.ProcessInfo(role="frontend", index=fe.index, pid=os.getpid(), state=ProcState.READY.value)]
    procs += [P.ProcessInfo(role="gpu", index=w.index, pid=w.pid, state=w.state.value, restarts=w.restarts,
                            device=w.device) for w in engine.workers]
    procs += [P.ProcessInfo(role="cpu", index=i, pid=c.pid, state=c.state.value, restarts=c.restarts, device="cpu")
              for i, c in enumerate(engine.compositors)]
    # NOTE: one rule with /readyz (probes.readiness); the op can say starting, ready or degraded, so
    # "not ready" and "draining" are degraded here.
    status, _ = fe.readiness()
    if status not in ("starting", "ready"):
        status = "degraded"
    return P.encode(P.HealthReply(id=call.header.id, status=status, processes=procs,
                                  models_loaded=engine.loaded(), version=_version()))


async def models(fe: Frontend, call: Call) -> bytes:
    """Every model with what is known of it now; models whose files are still being read (a cold
    start with thousands of models) come back `pending` and are read in the background."""
    tenant = call.reply_to.tenant
    ids = [i for i in await fe.catalog.ids() if tenant is None or tenant.allows(i)]
    specs = [fe.catalog.known(i) for i in ids]
    pending = [i for i, spec in zip(ids, specs) if spec is None]
    if pending:
        fe.catalog.warm(pending)
    if 0 < len(pending) <= MODELS_WAIT_FOR:   # a few unread models (one just added): worth a short wait
        deadline = time.monotonic() + MODELS_WAIT_S
        while time.monotonic() < deadline and any(fe.catalog.known(i) is None for i in pending):
            await asyncio.sleep(0.01)
        specs = [fe.catalog.known(i) for i in ids]
    loaded = fe.engine.loaded()
    models = []
    for model_id, spec in zip(ids, specs):
        if spec is None:
            models.append(P.ModelInfo(id=model_id, loaded_on=loaded.get(model_id, []), pending=True))
        elif isinstance(spec, CatalogError):
            models.append(P.ModelInfo(id=model_id, loaded_on=loaded.get(model_id, []), error=spec.message))
        else:
            models.append(P.ModelInfo(id=model_id, frames=spec.frames, width=spec.width, height=spec.height,
                                      audio_shape=list(spec.audio_shape), loaded_on=loaded.get(model_id, [])))
    return P.encode(P.ModelsReply(id=call.header.id, models=models))


def reply(fe: Frontend, r: Request) -> bytes:
    """The reply of a gathered op (load, unload, stats) that ended well."""
    call = r.work
    if r.kind is Kind.STATS:
        return _stats(fe, r)
    answered = {a.worker for a in r.results}
    loaded_on = fe.engine.loaded().get(r.model, [])
    if r.kind is Kind.LOAD:
        loaded_on = sorted(set(loaded_on) | answered)
    else:
        loaded_on = [i for i in loaded_on if i not in answered]
    return P.encode(P.LoadReply(id=call.header.id, model=r.model, loaded_on=loaded_on,
                                load_ms=max((a.load_ms for a in r.results), default=0.0)))


def _stats(fe: Frontend, r: Request) -> bytes:
    call = r.work
    workers = [{"index": a.worker, "device": a.device, "loaded": a.loaded, "queue": a.queue,
                **({"architectures": a.architectures} if a.architectures else {}),
                **({"steps": a.steps} if a.steps else {})} for a in r.results]
    tenant = call.reply_to.tenant
    wanted = call.header.model
    models = {k: v for k, v in merge_model_stats(r.results).items()
              if wanted in (None, k) and (tenant is None or tenant.allows(k))}
    workers += [{"index": i, "error": f"no answer within {fe.engine.stats_timeout_s:g} s"} for i in sorted(r.waiting_on)]
    store = {m: dict(v) for m, v in fe.store_lookups.items() if m in models or wanted == m}
    return P.encode(P.StatsReply(id=call.header.id, models=models, workers=workers, store=store))
