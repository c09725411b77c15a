"""What a first card would meet on the GPU path, shown on the CPU through the stand-in device (and a few
fakes built on it where only a card fails so): a CUDA-graph capture that fails, a session that would run
on another provider, a load the device has no memory for, the load thread's hold on the device, a size
dropped for memory, and a GPU worker on cuda:N touching GPU 0."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from config.schema import InferenceConfig
from gpu_actor.architectures import Architectures
from gpu_actor.device import StandInDevice
from gpu_actor.model_builder import write_model
from gpu_actor.onnx_sessions import (TIMED_CALLS, DeviceError, least_time, new_session, out_of_memory,
                                     session_options)
from gpu_actor.own_session import OwnSessionRunner
from gpu_actor.cuda_graphs import CAPTURE_RUNS
from gpu_actor.registry import Registry
from tests.helpers import ROOT

MAX_BATCH = 4
OPTIONS = InferenceConfig(max_models_per_worker=8, intra_op_threads=1)


def _inputs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 6, 320, 320), dtype=np.float32), rng.standard_normal((n, 32, 16, 16)).astype(np.float32)


def _cpu(path: Path, n: int) -> np.ndarray:
    out = np.empty((n, 3, 320, 320), np.float32)
    OwnSessionRunner(path).run(*_inputs(n), out)
    return out


class CaptureFails(StandInDevice):
    """A card whose CUDA-graph capture fails at `size` (a graph onnxruntime runs but cannot capture):
    a run that may capture raises, as onnxruntime's does; a plain run (graphs=False) works."""

    def __init__(self, size: int):
        super().__init__(0.0)
        self.size, self.plain_runs = size, 0

    def run(self, session, binding, size: int, graphs: bool = True, model: bool = True) -> None:
        if graphs and size == self.size:
            raise RuntimeError("CUDA failure 900: operation not permitted when stream is capturing")
        self.plain_runs += not graphs
        super().run(session, binding, size, graphs, model)


def test_a_size_whose_cuda_graph_capture_fails_runs_plainly_and_the_model_serves(tmp_path):
    path = write_model(tmp_path / "m.onnx", kind="tiny", seed=1)
    device = CaptureFails(size=2)
    runner = Architectures(device, MAX_BATCH, 0, False, graphs=True).load(path)
    prepared = runner.prepared
    assert prepared.graph_slot is not None and not prepared.graph_slot.plain
    for n in (2, 2, 1, 2):
        out = np.empty((n, 3, 320, 320), np.float32)
        runner.run(*_inputs(n), out)
        np.testing.assert_allclose(out, _cpu(path, n), rtol=0, atol=1e-6)
    assert prepared.graph_slot.plain == {2}   # the other sizes keep their graphs


def test_the_load_thread_never_captures_and_the_main_thread_captures_under_the_devices_lock(tmp_path):
    """onnxruntime keeps a CUDA graph per thread and captures inside the first run of a thread unless
    the run opts out: the load thread's warm-up runs opt out (graphs=False); the main thread's first
    CAPTURE_RUNS calls at a size run holding the device's lock, so no call of the load thread into the
    device breaks the capture."""
    calls: list[tuple[object, int, bool, bool]] = []

    class Recording(StandInDevice):
        def run(self, session, binding, size: int, graphs: bool = True, model: bool = True) -> None:
            calls.append((session, size, graphs, self.lock.locked()))
            super().run(session, binding, size, graphs, model)

    path = write_model(tmp_path / "m.onnx", kind="tiny", seed=1)
    runner = Architectures(Recording(0.0), MAX_BATCH, 0, False, graphs=True).load(path)
    prepared = runner.prepared
    models = set(prepared.sessions.values())
    warm = [(size, graphs, locked) for session, size, graphs, locked in calls if session in models]
    # a first call per size, then the timed ones (gpu_actor/onnx_sessions.least_time): none captures
    assert sorted(warm) == sorted([(size, False, True) for size in prepared.shapes.sizes] * (1 + TIMED_CALLS))
    calls.clear()
    for _ in range(CAPTURE_RUNS + 2):
        runner.run(*_inputs(3), np.empty((3, 3, 320, 320), np.float32))
    main = [(graphs, locked) for session, size, graphs, locked in calls if session is prepared.sessions[4]]
    assert main == [(True, True)] * CAPTURE_RUNS + [(True, False)] * 2


def test_a_prepared_calls_cost_is_the_least_of_its_timed_calls_each_under_the_devices_lock():
    """A busy host slows one timed call, not the size's cost (`auto` compares the costs per size); the
    device's lock is held around each call, and free once they are done."""
    import threading
    import time
    lock, seen = threading.Lock(), []
    durations = iter([0.3, 0.0, 0.3])

    def call() -> None:
        seen.append(lock.locked())
        time.sleep(next(durations))
    assert least_time(lock, call, calls=3) < 0.15
    assert seen == [True] * 3 and not lock.locked()


def test_a_session_that_would_run_on_the_cpu_instead_of_the_gpu_is_refused_and_named(tmp_path):
    """onnxruntime's Python wrapper makes a CPU session when the CUDA provider is missing or its session
    cannot be made there: every session of a GPU worker is checked (here the CUDA provider is missing)."""
    import onnxruntime as ort
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this host has the CUDA provider: tests/test_gpu.py checks its sessions")
    path = write_model(tmp_path / "m.onnx", kind="tiny")
    with pytest.raises(DeviceError, match="cannot use cuda:0: its CUDA provider did not load"):
        new_session(str(path), session_options(0, False), [("CUDAExecutionProvider", {"device_id": 0})], "cuda:0")


class NoMemoryOnce(StandInDevice):
    """A card with no memory for a new architecture's first call at batch 1 until something is freed."""

    crop_rows = None   # (a card's: the crops graph runs at the call's size)

    def __init__(self):
        super().__init__(0.0)
        self.full = False

    def run(self, session, binding, size: int, graphs: bool = True, model: bool = True) -> None:
        if self.full and size == 1:
            self.full = False
            raise RuntimeError("CUDNN_STATUS_ALLOC_FAILED: cudnnConvolutionForward failed")
        super().run(session, binding, size, graphs, model)


def test_out_of_memory_at_a_new_architectures_first_call_evicts_an_idle_model_and_loads_again(tmp_path):
    paths = {"idle": write_model(tmp_path / "idle.onnx", kind="tiny", seed=1),
             "new": write_model(tmp_path / "new.onnx", kind="tiny", audio="hubert", seed=2)}   # another architecture
    events: list = []
    device = NoMemoryOnce()
    reg = Registry(device, OPTIONS, 2, paths.get, lambda *e: events.append(e[:2]), lambda: None)

    def load(model: str) -> list:
        reg.start_load(model)
        results = []
        while not results:
            reg.loading[model].result(300)
            results = reg.poll_loads()
        return results

    assert load("idle")[0].error is None
    device.full = True
    result = load("new")[0]
    assert result.error is None and "new" in reg.loaded, result.error
    assert ("idle", "evicted") in events and "idle" not in reg.loaded
    reg.close()


def test_out_of_memory_is_told_by_cudnn_and_cublas_too():
    for text in ("CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation",
                 "Failed to allocate memory for requested buffer of size 123", "CUDA failure 2: out of memory"):
        assert out_of_memory(RuntimeError(text)), text
    assert out_of_memory(MemoryError()) and not out_of_memory(RuntimeError("Invalid input shape"))


class NoMemoryAbove(StandInDevice):
    """A card with memory for calls of up to `limit` frames."""

    crop_rows = None   # (a card's: the crops graph runs at the call's size)

    def __init__(self, limit: int):
        super().__init__(0.0)
        self.limit = limit

    def run(self, session, binding, size: int, graphs: bool = True, model: bool = True) -> None:
        if size > self.limit:
            raise RuntimeError(f"Failed to allocate memory for requested buffer of size {size << 30}")
        super().run(session, binding, size, graphs, model)


def test_a_size_dropped_for_memory_is_freed_with_its_bindings_and_batches_run_smaller(tmp_path):
    import gc
    import weakref
    made: list = []

    class Recording(NoMemoryAbove):
        def session(self, *args, **kwargs):
            session = super().session(*args, **kwargs)
            made.append(weakref.ref(session._sess))   # (onnxruntime's own session: an IO binding holds it)
            return session

    path = write_model(tmp_path / "m.onnx", kind="tiny", seed=1)
    archs = Architectures(Recording(2), 8, 0, False, graphs=True)
    runner = archs.load(path)
    second = archs.load(write_model(tmp_path / "m2.onnx", kind="tiny", seed=2))
    archs.prepare_more(weakref.ref(second))   # (2 models of the architecture)
    assert runner.prepared.shapes.sizes == (1, 2) and tuple(runner.prepared.grouped.sessions) == (2,)
    gc.collect()
    alive = [ref() for ref in made if ref() is not None]
    # the sizes kept, the crops graph, the N-model form's at the size kept
    assert len(alive) == len(runner.prepared.sessions) + 1 + 1, "a dropped size's session is still alive"
    out = np.empty((5, 3, 320, 320), np.float32)
    runner.run(*_inputs(5), out)
    np.testing.assert_allclose(out, _cpu(path, 5), rtol=0, atol=1e-6)


def test_steps_of_several_models_run_as_inference_mixed_steps_says_and_a_size_the_n_model_form_dropped_as_sub_calls(
        tmp_path):
    """`inference.mixed_steps: sub_calls` prepares no N-model form. `grouped` runs every step of several
    models in it, and admission's frames/s is what it runs (not the sub-calls', though faster), but a
    step whose rows pad to a size the form dropped (no memory for it, a failure) runs as sub-calls."""
    import weakref
    paths = [write_model(tmp_path / f"m{i}.onnx", kind="tiny", seed=i) for i in range(2)]

    def two_models(mixed: str):
        archs = Architectures(StandInDevice(0.0), 8, 0, False, mixed=mixed)
        runners = [archs.load(path) for path in paths]
        archs.prepare_more(weakref.ref(runners[1]))
        return runners

    runners = two_models("sub_calls")
    assert runners[0].prepared.grouped is None and not runners[0].prepared.prefers_grouped([1, 1])
    runners = two_models("grouped")
    p = runners[0].prepared
    assert tuple(p.grouped.sessions) == (2, 4, 8)
    assert p.prefers_grouped([1, 1]) and p.prefers_grouped([3, 5])
    # two models: admission counts steps of 4 frames of each, in one grouped call of 8 here, though a
    # call per model would run more (the times a card might measure)
    p.call_s = {1: 0.001, 2: 0.002, 4: 0.004, 8: 0.008}
    p.grouped.call_s = {2: 0.010, 4: 0.020, 8: 0.040}
    assert p.frames_per_s() == 8 / 0.040
    p.grouped._failed(8, RuntimeError("Failed to allocate memory for requested buffer"))
    assert p.prefers_grouped([2, 2]) and not p.prefers_grouped([3, 5])


def test_out_of_memory_at_the_smallest_size_is_an_out_of_memory_for_the_registry(tmp_path):
    paths = {"m": write_model(tmp_path / "m.onnx", kind="tiny")}
    reg = Registry(NoMemoryAbove(0), OPTIONS, 2, paths.get, lambda *e: None, lambda: None)
    reg.start_load("m")
    reg.loading["m"].result(60)
    (result,) = reg.poll_loads()   # no idle model to evict: the load fails, saying what to do
    assert result.runner is None and result.code == "overloaded", result
    assert "no device memory" in result.error
    reg.close()


def test_the_load_thread_holds_the_device_for_one_call_at_a_time_never_a_whole_load(tmp_path):
    """A new architecture's load runs many stalling first calls; the main thread (a capture) gets the
    device's lock within about one of them, not after the whole load."""
    stall = 0.3
    path = write_model(tmp_path / "m.onnx", kind="tiny")
    device = StandInDevice(stall)
    archs = Architectures(device, 8, 0, False)
    loader = threading.Thread(target=archs.load, args=(path,))
    t0 = time.monotonic()
    loader.start()
    waits = []
    while loader.is_alive():
        t = time.monotonic()
        with device.lock:
            waits.append(time.monotonic() - t)
        time.sleep(stall / 3)
    load_s = time.monotonic() - t0
    # four sizes' model calls, and the crops graph at each count of rows a call of it holds, all stalling
    assert load_s >= (4 + device.crop_rows) * stall
    assert max(waits) < load_s / 2 and max(waits) <= 3 * stall, (max(waits), load_s)


def test_no_gpu_code_switches_devices_through_cupys_context_manager():
    """cupy's `with Device(n)` sets the previous device back on exit, and since CUDA 12 making device 0
    current creates its context: a worker on cuda:1 would hold ~500 MB of GPU 0 (CudaDevice.bind_thread
    sets each thread's device once instead)."""
    offenders = []
    for path in sorted((ROOT / "gpu_actor").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.With):
                for item in node.items:
                    call = item.context_expr
                    if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("cuda.Device"):
                        offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
