"""The GPU path's pieces on the CPU: the batch-size table, an architecture's key, one prepared session per
architecture with each model's weights bound per call (run on the stand-in device), and what a bad weight
file or a replaced one does."""

from __future__ import annotations

import time
import weakref

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from config.assets import AssetError
from config.schema import InferenceConfig
from gpu_actor.architectures import Architectures
from gpu_actor.device import CpuDevice, StandInDevice
from gpu_actor.model_builder import build_model, write_model
from gpu_actor.model_split import split_model
from gpu_actor.own_session import OwnSessionRunner
from gpu_actor.registry import Registry
from gpu_actor.shapes import BatchShapes, Step, prepared_sizes
from gpu_actor.visual import VisualFrames, build_visual
from gpu_actor.weights import ALIGN, layout

OPTIONS = InferenceConfig(max_models_per_worker=4, intra_op_threads=1)


# -- the batch-size table ------------------------------------------------------------------------------

def test_prepared_sizes_are_powers_of_two_up_to_max_batch_one_frame_on_the_cpu_or_a_fixed_batch():
    assert prepared_sizes(8) == (1, 2, 4, 8)
    assert prepared_sizes(24) == (1, 2, 4, 8, 16, 24)
    assert prepared_sizes(1) == (1,)
    assert prepared_sizes(64, batched=False) == (1,)
    assert prepared_sizes(64, fixed=2) == (2,)


def test_a_batch_of_any_size_runs_at_prepared_sizes_padded_at_most_2x():
    for max_batch in (1, 5, 8, 24, 32, 256):
        shapes = BatchShapes(prepared_sizes(max_batch))
        for n in range(1, 3 * max_batch + 2):
            chunks = shapes.plan(n)
            assert chunks[0].start == 0 and chunks[-1].end == n
            assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
            assert all(c.size in shapes.sizes and c.end - c.start <= c.size < 2 * (c.end - c.start) for c in chunks)
    assert BatchShapes((1, 2, 4, 8)).plan(11) == [Step(0, 8, 8), Step(8, 11, 4)]
    assert BatchShapes((2,)).plan(3) == [Step(0, 2, 2), Step(2, 3, 2)]
    with pytest.raises(ValueError):
        BatchShapes((1, 2)).pad_to(3)


# -- an architecture ---------------------------------------------------------------------------------------

def test_models_built_alike_share_an_architecture_whatever_their_weights_and_tensor_names(tmp_path):
    one = split_model(write_model(tmp_path / "1.onnx", kind="unet328", seed=1))
    two = split_model(write_model(tmp_path / "2.onnx", kind="unet328", seed=2))
    assert one.architecture.key == two.architecture.key
    assert not np.array_equal(one.weights[0], two.weights[0])
    assert one.architecture.nbytes == sum(w.nbytes for w in one.weights) > 40e6
    renamed = build_model("tiny", seed=3)
    names = {t.name: f"renamed_{i}" for i, t in enumerate(renamed.graph.initializer)}
    for t in renamed.graph.initializer:
        t.name = names[t.name]
    for node in renamed.graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
    onnx.save(renamed, tmp_path / "renamed.onnx")
    tiny = split_model(write_model(tmp_path / "tiny.onnx", kind="tiny", seed=4)).architecture
    assert split_model(tmp_path / "renamed.onnx").architecture.key == tiny.key != one.architecture.key
    other_audio = split_model(write_model(tmp_path / "hubert.onnx", kind="tiny", audio="hubert")).architecture
    assert other_audio.key != tiny.key


def _inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.random((n, 6, 320, 320), dtype=np.float32),
            rng.standard_normal((n, 32, 16, 16)).astype(np.float32))


@pytest.mark.parametrize("kind", ["tiny", "unet328"])
def test_a_shared_session_with_the_weights_bound_per_call_computes_what_the_models_own_session_does(tmp_path, kind):
    paths = [write_model(tmp_path / f"{k}.onnx", kind=kind, seed=k) for k in range(2)]
    device = StandInDevice(0.0)
    archs = Architectures(device, 4, 0, False)
    runners = [archs.load(p) for p in paths]
    assert len(archs.prepared) == 1 and runners[0].prepared is runners[1].prepared
    for n in (1, 3, 6) if kind == "tiny" else (1, 3):   # 3: padded to 4; 6: a full 4 and 2
        visual, audio = _inputs(n, seed=n)
        for path, runner in zip(paths, runners):
            got, want = np.empty((n, 3, 320, 320), np.float32), np.empty((n, 3, 320, 320), np.float32)
            runner.run(visual, audio, got)
            OwnSessionRunner(path).run(visual, audio, want)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("crop_rows", [None, 2], ids=["crops-one-call", "crops-in-pairs"])
def test_the_visual_input_built_per_call_and_padding_rows_left_by_a_larger_call_change_nothing(tmp_path, crop_rows):
    """A batch of 5 runs at size 8: its rows 5..7 are zeros in the model's staging buffers (visual, audio),
    whatever a call of 8 left there, crops or float visuals, and in the crops' too where the crops graph
    runs at the call's size (a card's; a CPU's runs the real rows, two a call); its mouths are the model's
    own."""
    path = write_model(tmp_path / "m.onnx", kind="tiny", seed=5)
    device = StandInDevice(0.0)
    device.crop_rows = crop_rows
    runner = Architectures(device, 8, 0, False).load(path)
    p = runner.prepared
    rng = np.random.default_rng(1)
    crops = [rng.integers(1, 256, (328, 328, 3), dtype=np.uint8) for _ in range(8)]
    visual = np.empty((5, 6, 320, 320), np.float32)
    build_visual(crops[:5], visual)
    _, audio = _inputs(5)

    def dirty() -> None:   # calls of 8: every staging row holds something
        runner.run(VisualFrames(crops, np.empty((8, 6, 320, 320), np.float32)), _inputs(8, seed=9)[1],
                   np.empty((8, 3, 320, 320), np.float32))
        runner.run(*_inputs(8, seed=9), np.empty((8, 3, 320, 320), np.float32))
        assert p.visual[5:].any() and p.audio[5:].any() and p.crops[5:].any() and p.crops_host[5:].any()

    want = np.empty((5, 3, 320, 320), np.float32)
    OwnSessionRunner(path).run(visual, audio, want)
    dirty()
    got = np.empty((5, 3, 320, 320), np.float32)
    runner.run(VisualFrames(crops[:5], np.empty((8, 6, 320, 320), np.float32)), audio, got)
    assert not (p.visual[5:].any() or p.audio[5:].any())
    assert crop_rows is not None or not (p.crops_host[5:].any() or p.crops[5:].any())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    dirty()
    runner.run(visual, audio, got)
    assert not (p.visual[5:].any() or p.audio[5:].any())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_the_stand_ins_cost_curve_counts_the_crops_graph_within_the_model_call_it_feeds(tmp_path, monkeypatch):
    """A card builds a call's input from the crops in a few us a frame; the stand-in's CPU takes about the
    curve's per-frame part for it. So a model call fed by the crops graph waits for the curve less that
    graph's time (the step lasts the curve), and one with a client's float input waits for all of it."""
    import gpu_actor.device as device_module
    waits: list[float] = []
    clock = type("Clock", (), {"perf_counter": staticmethod(time.perf_counter),
                               "sleep": staticmethod(lambda s: waits.append(s))})
    monkeypatch.setattr(device_module, "time", clock)
    curve_s = 5.0
    runner = Architectures(StandInDevice(0.0, cost_s=(curve_s, 0.0)), 8, 0, False).load(
        write_model(tmp_path / "m.onnx", kind="tiny", seed=5))
    rng = np.random.default_rng(1)
    crops = [rng.integers(0, 256, (328, 328, 3), dtype=np.uint8) for _ in range(8)]
    out, (visual, audio) = np.empty((8, 3, 320, 320), np.float32), _inputs(8)
    counted = []
    for _ in range(3):
        waits.clear()
        t0 = time.perf_counter()
        runner.run(VisualFrames(crops, np.empty((8, 6, 320, 320), np.float32)), audio, out)
        with_crops_s = time.perf_counter() - t0
        runner.run(visual, audio, out)
        fed, plain = waits
        assert fed + with_crops_s >= curve_s > plain   # (the curve less the model call's own time)
        # the first run's time beyond the second's model call: the crops' (and the copies around them)
        counted.append((plain - fed) / (with_crops_s - (curve_s - plain)))
    # (the best of three: a thread preempted mid-call adds to one run's times; ~0.7 here, ~0 uncounted)
    assert max(counted) >= 0.4, counted


def test_the_first_model_prepares_every_size_once_later_models_of_its_architecture_none(tmp_path):
    stall = 0.2
    device = StandInDevice(stall)
    archs = Architectures(device, 8, 0, False)
    t0 = time.perf_counter()
    first = archs.load(write_model(tmp_path / "a.onnx", kind="tiny", seed=1))
    # the model's sessions at sizes 1, 2, 4, 8, and the crops graph at the rows a call of it holds (the
    # stand-in computes on a CPU: 1 or 2)
    per_architecture = 4 + device.crop_rows
    prepared = device.stalls
    assert prepared == per_architecture and time.perf_counter() - t0 >= prepared * stall
    second = archs.load(write_model(tmp_path / "b.onnx", kind="tiny", seed=2))
    rng = np.random.default_rng(2)
    crops = [rng.integers(0, 256, (328, 328, 3), dtype=np.uint8) for _ in range(11)]
    for n in range(1, 12):
        second.run(*_inputs(n), np.empty((n, 3, 320, 320), np.float32))
        second.run(VisualFrames(crops[:n], np.empty((n, 6, 320, 320), np.float32)), _inputs(n)[1],
                   np.empty((n, 3, 320, 320), np.float32))
    assert device.stalls == prepared, "a call met a size that was not prepared"
    # with a second model loaded, the load thread prepares the N-model form at 2, 4, 8 (after the load),
    # at 8 both ways of its 1x1 convolutions
    archs.prepare_more(weakref.ref(second))
    assert device.stalls == prepared + 4 and tuple(first.prepared.grouped.sessions) == (2, 4, 8)
    grouped = first.prepared.grouped
    assert set(grouped.pointwise_s) == {"conv", "matmul"}
    assert grouped.pointwise == min(grouped.pointwise_s, key=grouped.pointwise_s.get)
    prepared = device.stalls
    archs.load(write_model(tmp_path / "other.onnx", kind="tiny", audio="hubert"))
    assert device.stalls == prepared + per_architecture and len(archs.prepared) == 2   # a graph like no other: its own
    del first, second


def test_a_weight_that_does_not_fit_its_graph_fails_that_load_naming_the_tensor_and_both_shapes(tmp_path):
    model = build_model("tiny")
    weight = model.graph.initializer[0]
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight)[:, :5].copy(), weight.name))
    onnx.save(model, tmp_path / "bad.onnx")
    events = []
    paths = {"bad": tmp_path / "bad.onnx", "good": write_model(tmp_path / "good.onnx", kind="tiny")}
    reg = Registry(StandInDevice(0.0), OPTIONS, 4, paths.get, lambda *e: events.append(e[:2]), lambda: None)
    for model_id in ("bad", "good"):
        reg.start_load(model_id)
        reg.loading[model_id].result(60)
    results = {r.model: r for r in reg.poll_loads()}
    assert results["bad"].runner is None and results["bad"].code == "bad_request"
    assert "tiny.weight is [3, 5, 1, 1]" in results["bad"].error and "[3, 6, 1, 1]" in results["bad"].error
    assert "good" in reg.loaded and ("bad", "failed") in events
    reg.close()


def test_a_model_replaced_on_disk_and_unloaded_serves_its_new_weights(tmp_path):
    path = tmp_path / "m.onnx"
    write_model(path, kind="tiny", seed=1)
    reg = Registry(StandInDevice(0.0), OPTIONS, 4, {"m": path}.get, lambda *e: None, lambda: None)

    def run() -> np.ndarray:
        reg.start_load("m")
        if "m" in reg.loading:
            reg.loading["m"].result(60)
            reg.poll_loads()
        out = np.empty((2, 3, 320, 320), np.float32)
        reg.loaded["m"].runner.run(*_inputs(2), out)
        return out

    old = run()
    write_model(path, kind="tiny", seed=2)
    assert reg.unload("m")
    new = run()
    want = np.empty((2, 3, 320, 320), np.float32)
    OwnSessionRunner(path).run(*_inputs(2), want)
    assert not np.allclose(old, new)
    np.testing.assert_allclose(new, want, rtol=0, atol=1e-6)
    weights = split_model(path).architecture
    assert reg.stat("m").nbytes == reg.loaded["m"].runner.nbytes
    assert weights.nbytes <= reg.stat("m").nbytes <= weights.nbytes + ALIGN * len(weights.weights)
    reg.close()


def test_weights_lie_in_one_buffer_at_aligned_offsets():
    offsets, total = layout(((3, 6, 1, 1), (3,), (5,)), (np.dtype(np.float32),) * 2 + (np.dtype(np.float16),))
    assert offsets == [0, ALIGN, 2 * ALIGN] and total == 3 * ALIGN


def test_with_cuda_graphs_models_that_alternate_each_get_their_own_weights_in_the_slot(tmp_path):
    """inference.cuda_graphs: every call binds the architecture's one weight slot (a graph replays the
    addresses it captured); a model's weights are copied in when another model ran last. Run on the
    stand-in, which binds alike (onnxruntime's graphs themselves need a card: tests/test_gpu.py)."""
    paths = [write_model(tmp_path / f"{k}.onnx", kind="tiny", seed=k) for k in range(3)]
    archs = Architectures(StandInDevice(0.0), 4, 0, False, graphs=True)
    runners = [archs.load(p) for p in paths]
    prepared = runners[0].prepared
    assert prepared.graph_slot is not None
    visual, audio = _inputs(3)
    want = []
    for path in paths:
        want.append(np.empty((3, 3, 320, 320), np.float32))
        OwnSessionRunner(path).run(visual, audio, want[-1])
    copies = 0
    for k in (0, 1, 1, 2, 0, 2, 2, 1):
        copies += prepared.graph_slot.holds() is not runners[k].weights
        got = np.empty((3, 3, 320, 320), np.float32)
        runners[k].run(visual, audio, got)
        np.testing.assert_allclose(got, want[k], rtol=0, atol=1e-6)
        assert prepared.graph_slot.holds() is runners[k].weights
    assert copies == 5   # the first model's are in the slot since preparation; the same model twice copies nothing


def test_a_load_the_device_has_no_room_for_evicts_an_idle_model_first_and_never_a_held_one(tmp_path):
    paths = {m: write_model(tmp_path / f"{m}.onnx", kind="tiny", seed=k) for k, m in enumerate("abcd")}
    weights = Architectures(StandInDevice(0.0), 2, 0, False).load(paths["a"]).nbytes
    device = StandInDevice(0.0, memory_bytes=2 * weights)   # a card with room for two models' weights
    events: list = []
    reg = Registry(device, InferenceConfig(max_models_per_worker=8, intra_op_threads=1), 2, paths.get,
                   lambda *e: events.append(e[:2]), lambda: None)

    def load(model: str):
        reg.start_load(model)
        while model in reg.loading:   # (a retry after an eviction is a new future)
            reg.loading[model].result(60)
            results = reg.poll_loads()
        return results[-1]

    assert load("a").error is None and load("b").error is None
    reg.pin("a")                          # a live session holds a
    assert load("c").error is None              # b, idle, made room
    assert ("b", "evicted") in events and set(reg.loaded) == {"a", "c"}
    reg.pin("c")
    failed = load("d")                          # nothing idle: that load fails, the held ones stay
    assert failed.runner is None and failed.code == "overloaded" and "no memory" in failed.error, failed
    assert set(reg.loaded) == {"a", "c"}
    for model in ("a", "c"):
        out = np.empty((1, 3, 320, 320), np.float32)
        reg.loaded[model].runner.run(*_inputs(1), out)
        want = np.empty((1, 3, 320, 320), np.float32)
        OwnSessionRunner(paths[model]).run(*_inputs(1), want)
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-6)
    reg.close()


def test_every_device_has_all_the_runners_and_the_registry_ask_of_one():
    """CudaDevice runs only where there is a card: a method it lacks, or one called with parameters it
    does not take, would fail the first GPU run. Each method's parameters are the protocol's, by name and
    order; each attribute is set on the class or by its constructor."""
    import inspect

    from gpu_actor.cuda import CudaDevice
    from gpu_actor.device import CpuDevice, Device
    methods = {name: inspect.signature(getattr(Device, name)) for name in dir(Device)
               if not name.startswith("_") and callable(getattr(Device, name))}
    attributes = list(Device.__annotations__)
    for cls in (CpuDevice, StandInDevice, CudaDevice):
        for name, want in methods.items():
            assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(want.parameters), f"{cls.__name__}.{name}{got}, the protocol: {want}"
            defaults = [p.default for p in want.parameters.values()]
            assert [p.default for p in got.parameters.values()] == defaults, f"{cls.__name__}.{name}{got} vs {want}"
        constructors = "".join(inspect.getsource(c.__init__) for c in cls.__mro__[:-1] if "__init__" in vars(c))
        for name in attributes:
            assert any(name in vars(c) for c in cls.__mro__) or f"self.{name} =" in constructors or \
                f"self.{name}," in constructors, f"{cls.__name__} has no {name}"


def test_both_loaders_and_their_runners_honour_the_runner_contract(tmp_path):
    """The registry holds either loader as a gpu_actor/runner.Loader and the worker either runner as a
    gpu_actor/runner.Runner: the protocols' methods with their parameters, the runners' attributes with
    their types (the bytes a model holds counted by either), the same refusal of audio of another shape."""
    import inspect

    from gpu_actor.own_session import OwnSessions
    from gpu_actor.runner import Loader, Runner
    path = write_model(tmp_path / "m.onnx", kind="tiny")
    loaders = (OwnSessions(CpuDevice(), 0, False), Architectures(StandInDevice(0.0), 2, 0, False))
    for loader in loaders:
        for name in ("load", "prepare_more", "describe"):
            assert list(inspect.signature(getattr(type(loader), name)).parameters) == \
                list(inspect.signature(getattr(Loader, name)).parameters), (type(loader), name)
    runners = [loader.load(path) for loader in loaders]
    want = list(inspect.signature(Runner.run).parameters)
    for runner in runners:
        assert isinstance(runner.nbytes, int) and runner.nbytes > 0, (type(runner), runner.nbytes)
        assert isinstance(runner.frames_per_s, float), type(runner)
        assert runner.io.audio_shape == (32, 16, 16)
        assert list(inspect.signature(type(runner).run).parameters) == want, type(runner)
        with pytest.raises(AssetError, match=r"audio must be \[2, 32, 16, 16\], got \[2, 32, 16\]"):
            runner.run(*_inputs(2)[:1], np.zeros((2, 32, 16), np.float32), np.empty((2, 3, 320, 320), np.float32))


def test_a_session_closing_releases_its_own_processes_pin_and_a_restart_only_its_own():
    """Two client-facing processes pin the same model (their live sessions): a session of the first
    closing releases the first's pin, so the second's restart drops the second's and the model is held
    no more (before, an unpin took the newest pin whoever made it, and the first's stayed for good)."""
    from shm.requests import first_id
    reg = Registry(StandInDevice(0.0), InferenceConfig(max_models_per_worker=8, intra_op_threads=1), 2,
                   lambda m: None, lambda *e: None, lambda: None)
    a, b = first_id(0, 1000), first_id(1, 1000)
    reg.pin("m", a + 5)
    reg.pin("m", b + 7)
    reg.unpin("m", a)                      # (an unpin carries its process's first id)
    assert reg.pins == {"m": [b + 7]}
    reg.unpin("m", a)                      # none of the first's left: nothing goes
    assert reg.pins == {"m": [b + 7]}
    assert reg.drop_pins_below(first_id(1, 2000)) == 1 and reg.pins == {}
    reg.close()
