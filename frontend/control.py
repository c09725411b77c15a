"""The control ops: health, models, load, unload, stats; each a function over the frontend's state.

load / unload / stats go to the inference workers and are answered when every worker asked has
replied (`gathered`), stats after at most STATS_TIMEOUT_S with whatever came.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from frontend import protocol as P
from frontend.catalog import CatalogError
from frontend.state import Pending
from frontend.validate import RequestError
from shm.messages import LoadDone, LoadModel, StatsQuery, StatsReport, UnloadModel, encode, merge_model_stats

if TYPE_CHECKING:
    from frontend.server import Frontend

STATS_TIMEOUT_S = 2.0


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("lipsync-serve")
    except Exception:
        return "0.0.0"


async def health(fe: Frontend, p: Pending, payload: list) -> None:
    procs = [P.ProcessInfo(role="frontend", index=0, pid=os.getpid(), state="ready")]
    procs += [P.ProcessInfo(role="gpu", index=w.index, pid=w.pid, state=w.state, restarts=w.restarts,
                            device=w.device) for w in fe.workers]
    procs += [P.ProcessInfo(role="cpu", index=i, pid=c.pid, state=c.state, restarts=c.restarts, device="cpu")
              for i, c in enumerate(fe.compositors)]
    states = {pr.state for pr in procs}
    if states == {"ready"}:
        status = "ready"
    elif all(pr.restarts == 0 and pr.state in ("starting", "ready") for pr in procs):
        status = "starting"
    else:
        status = "degraded"
    loaded: dict[str, list[int]] = {}
    for w in fe.workers:
        for model in w.models:
            loaded.setdefault(model, []).append(w.index)
    fe.finish(p, P.encode(P.HealthReply(id=p.header.id, status=status, processes=procs,
                                           models_loaded=loaded, version=_version())))

async def models(fe: Frontend, p: Pending, payload: list) -> None:
    ids = [i for i in fe.catalog.ids() if p.client.tenant is None or p.client.tenant.allows(i)]
    specs = await asyncio.gather(*(fe.catalog.get(i) for i in ids))
    models = []
    for model_id, spec in zip(ids, specs):
        loaded_on = [w.index for w in fe.workers if model_id in w.models]
        if isinstance(spec, CatalogError):
            models.append(P.ModelInfo(id=model_id, loaded_on=loaded_on, error=spec.message))
        else:
            models.append(P.ModelInfo(id=model_id, frames=spec.frames, width=spec.width, height=spec.height,
                                      audio_shape=list(spec.audio_shape), loaded_on=loaded_on))
    fe.finish(p, P.encode(P.ModelsReply(id=p.header.id, models=models)))

async def load(fe: Frontend, p: Pending, payload: list) -> None:
    await fe.model_spec(p)
    worker = fe.pick_worker(p.header.model)
    if worker is None:
        raise RequestError(P.ErrorCode.UNAVAILABLE, fe.no_worker_message(), p.header.id)
    p.waiting_on = {worker.index}
    worker.sock.send(encode(LoadModel(req=p.req, model=p.header.model)))

async def unload(fe: Frontend, p: Pending, payload: list) -> None:
    if p.header.model not in fe.catalog.ids():
        raise RequestError(P.ErrorCode.UNKNOWN_MODEL, f"unknown model {p.header.model!r}", p.header.id)
    fe.catalog.forget(p.header.model)
    # Every ready worker, not only those this process believes hold the model: what a GPU host
    # holds is learned from its heartbeats and may lag a request that just loaded it.
    targets = [w for w in fe.workers if w.ready]
    if not targets:
        fe.finish(p, P.encode(P.LoadReply(id=p.header.id, model=p.header.model, loaded_on=[])))
        return
    p.waiting_on = {w.index for w in targets}
    for w in targets:
        w.sock.send(encode(UnloadModel(req=p.req, model=p.header.model)))

async def stats(fe: Frontend, p: Pending, payload: list) -> None:
    targets = [w for w in fe.workers if w.ready]
    p.waiting_on = {w.index for w in targets}
    for w in targets:
        w.sock.send(encode(StatsQuery(req=p.req)))
    if not targets:
        stats_reply(fe, p)
        return
    asyncio.get_running_loop().call_later(STATS_TIMEOUT_S, stats_reply, fe, p)

def gathered(fe: Frontend, msg: LoadDone | StatsReport) -> None:
    p = fe.requests.get(msg.req)
    if p is None or msg.worker not in p.waiting_on:
        return
    p.waiting_on.discard(msg.worker)
    p.results.append(msg)
    if p.waiting_on:
        return
    if p.op is P.Op.STATS:
        stats_reply(fe, p)
        return
    failed = next((r for r in p.results if not r.ok), None)
    if failed is not None:
        fe.finish(p, code=failed.code, message=failed.message)
        return
    loaded_on = [w.index for w in fe.workers if p.header.model in w.models]
    if p.op is P.Op.LOAD:
        loaded_on = sorted(set(loaded_on) | {r.worker for r in p.results})
    else:
        loaded_on = [i for i in loaded_on if i not in {r.worker for r in p.results}]
    fe.finish(p, P.encode(P.LoadReply(id=p.header.id, model=p.header.model, loaded_on=loaded_on,
                                         load_ms=max(r.load_ms for r in p.results))))

def stats_reply(fe: Frontend, p: Pending) -> None:
    if p.req not in fe.requests:
        return
    workers = [{"index": r.worker, "device": r.device, "loaded": r.loaded, "queue": r.queue} for r in p.results]
    models = merge_model_stats(p.results)
    tenant = p.client.tenant
    models = {k: v for k, v in models.items() if p.header.model in (None, k) and (tenant is None or tenant.allows(k))}
    missing = sorted(p.waiting_on)
    if missing:
        workers += [{"index": i, "error": "no answer within 2 s"} for i in missing]
    store = {m: dict(v) for m, v in fe.store_lookups.items() if m in models or p.header.model == m}
    fe.finish(p, P.encode(P.StatsReply(id=p.header.id, models=models, workers=workers, store=store)))
