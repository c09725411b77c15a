"""gpu_actor: the model builder, the runner against onnxruntime itself, and the multi-tenant registry."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from config.assets import AssetError
from frontend.server.onnx_io import read_model_io
from config.schema import InferenceConfig
from gpu_actor.cuda import CudaDevice
from gpu_actor.device import CpuDevice, make_device
from gpu_actor.model_builder import AUDIO_SHAPES, build_model, describe, write_model
from gpu_actor.onnx_sessions import DeviceError, new_session, session_options
from gpu_actor.own_session import OwnSessionRunner, own_session
from gpu_actor.registry import Registry


def _inputs(batch, audio_shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((batch, 6, 320, 320), dtype=np.float32),
            rng.standard_normal((batch, *audio_shape)).astype(np.float32))


def _direct(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_unet328_builder_has_the_real_networks_size_and_cost():
    model = build_model("unet328", "ave", seed=1)
    info = describe(model)
    # 12.19 M with batch-norm parameters in the real network; folded into the convolutions here.
    assert 12.0e6 < info["parameters"] < 12.3e6
    assert 4.8 < info["gmac_per_frame"] < 5.0
    assert model.opset_import[0].version == 11
    visual, audio = model.graph.input
    assert visual.type.tensor_type.shape.dim[0].dim_param == "batch"
    assert [d.dim_value for d in audio.type.tensor_type.shape.dim[1:]] == [32, 16, 16]


@pytest.mark.parametrize("audio", sorted(AUDIO_SHAPES))
def test_runner_matches_onnxruntime_for_every_audio_encoder(tmp_path, audio):
    path = write_model(tmp_path / "m.onnx", kind="tiny", audio=audio, seed=3)
    runner = OwnSessionRunner(path)
    assert runner.io.audio_shape == AUDIO_SHAPES[audio]
    visual, feats = _inputs(3, AUDIO_SHAPES[audio])
    out = np.empty((3, 3, 320, 320), np.float32)
    runner.run(visual, feats, out)
    np.testing.assert_array_equal(out, _direct(path, {"input": visual, "audio": feats}))


def test_runner_matches_onnxruntime_on_the_unet328_shaped_model(tmp_path):
    path = write_model(tmp_path / "unet.onnx", kind="unet328", audio="hubert", seed=2)
    runner = OwnSessionRunner(path)
    visual, feats = _inputs(2, (32, 32, 32))
    out = np.empty((2, 3, 320, 320), np.float32)
    runner.run(visual, feats, out)
    np.testing.assert_allclose(out, _direct(path, {"input": visual, "audio": feats}), rtol=0, atol=1e-6)
    assert 0 < out.min() and out.max() < 1


def test_fixed_batch_model_is_split_and_padded_and_names_are_found_by_shape(tmp_path):
    path = write_model(tmp_path / "fixed.onnx", kind="tiny", audio="wenet", batch=2, visual_name="image",
                       audio_name="feats")
    runner = OwnSessionRunner(path)
    assert (runner.io.visual, runner.io.audio, runner.io.batch) == ("image", "feats", 2)
    visual, feats = _inputs(5, (256, 16, 32))
    out = np.empty((5, 3, 320, 320), np.float32)
    runner.run(visual, feats, out)
    for i in range(5):
        pair = {"image": np.repeat(visual[i:i + 1], 2, 0), "feats": np.repeat(feats[i:i + 1], 2, 0)}
        np.testing.assert_array_equal(out[i], _direct(path, pair)[0])


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_a_gpu_worker_never_runs_on_the_cpu_silently(tmp_path):
    """onnxruntime falls back to the CPU when its CUDA provider cannot load; a worker for cuda:0 must
    refuse instead, saying what to install or configure."""
    path = write_model(tmp_path / "m.onnx", kind="tiny")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        device = make_device("cuda:0")
        device.check()
        assert own_session(path, device, 0).get_providers()[0] == "CUDAExecutionProvider"
        return
    with pytest.raises(DeviceError, match="inference.devices: cpu"):   # (no cupy, or no CUDA provider)
        make_device("cuda:0").check()
    with pytest.raises(DeviceError, match="CUDA provider did not load"):
        new_session(str(path), session_options(0, False), CudaDevice.providers_for(0), "cuda:0")


def test_broken_models_are_refused_with_the_reason(tmp_path):
    with pytest.raises(AssetError, match="missing"):
        OwnSessionRunner(tmp_path / "nope.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"this is not a model")
    with pytest.raises(AssetError, match="garbage.onnx"):
        OwnSessionRunner(garbage)
    with pytest.raises(AssetError, match="garbage.onnx"):
        read_model_io(garbage)
    wrong = tmp_path / "wrong.onnx"
    model = build_model("tiny")
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 3  # visual with 3 channels
    onnx.save(model, str(wrong))
    with pytest.raises(AssetError, match=r"\[B,6,320,320\]"):
        read_model_io(wrong)


# -- registry -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ten_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    paths = {f"m{i}": write_model(root / f"m{i}.onnx", kind="tiny", seed=i) for i in range(10)}
    broken = root / "broken.onnx"
    broken.write_bytes(b"\x00" * 100)
    paths["broken"] = broken
    return paths


def _registry(paths, eviction="lru", max_models=3, max_bytes=0, events=None):
    events = events if events is not None else []
    options = InferenceConfig(max_models_per_worker=max_models, max_model_bytes=max_bytes, eviction=eviction,
                              intra_op_threads=1)
    return Registry(CpuDevice(), options, 1, paths.get, lambda m, e, ms, b, fps: events.append((m, e)), lambda: None)


def _load(reg: Registry, model: str):
    assert reg.start_load(model)
    deadline = time.monotonic() + 60
    while model in reg.loading and time.monotonic() < deadline:
        reg.loading[model].result(60)
        reg.poll_loads()
    return reg.stats[model]


def test_lru_eviction_keeps_at_most_the_cap(ten_models):
    events = []
    reg = _registry(ten_models, "lru", events=events)
    for i in range(10):
        _load(reg, f"m{i}")
        reg.touch(f"m{i}", 1)
        if i >= 2:
            reg.touch("m0", 1)  # m0 stays the most recently used of the old ones
        assert len(reg.loaded) <= 3
    assert set(reg.loaded) == {"m0", "m8", "m9"}
    evicted = [m for m, e in events if e == "evicted"]
    assert evicted == [f"m{i}" for i in range(1, 8)]
    reg.close()


def test_lfu_evicts_the_least_used(ten_models):
    reg = _registry(ten_models, "lfu")
    for name, uses in (("m0", 5), ("m1", 1), ("m2", 3)):
        _load(reg, name)
        for _ in range(uses):
            reg.touch(name, 1)
    _load(reg, "m3")
    assert set(reg.loaded) == {"m0", "m2", "m3"}  # m1 had the fewest uses
    reg.close()


def test_busy_model_is_never_evicted(ten_models):
    reg = _registry(ten_models, "lru")
    for name in ("m0", "m1", "m2"):
        _load(reg, name)
    reg.queued("m0")   # work queued for the least recently used model
    _load(reg, "m3")
    assert "m0" in reg.loaded and "m1" not in reg.loaded
    assert not reg.unload("m0")  # an explicit unload of a busy model is refused too
    reg.finished("m0")
    assert reg.unload("m0") and "m0" not in reg.loaded
    reg.close()


def test_byte_cap_bounds_memory(ten_models):
    reg = _registry(ten_models, "lru", max_models=10, max_bytes=1)
    for i in range(4):
        _load(reg, f"m{i}")
        assert len(reg.loaded) == 1  # every model costs more than one byte: one at a time
        assert reg.stats[f"m{i}"].loads == 1
    reg.close()


def test_broken_model_fails_alone(ten_models):
    reg = _registry(ten_models, "lru")
    _load(reg, "m0")
    assert reg.start_load("broken")
    reg.loading["broken"].result(60)
    results = reg.poll_loads()
    assert results[0].error and "broken.onnx" in results[0].error and results[0].code == "bad_request"
    assert "broken" not in reg.loaded and "m0" in reg.loaded
    assert not reg.start_load("no-such-model")
    visual, feats = _inputs(1, (32, 16, 16))
    out = np.empty((1, 3, 320, 320), np.float32)
    reg.loaded["m0"].runner.run(visual, feats, out)  # still serving
    reg.close()


def test_idle_models_are_unloaded_but_busy_ones_stay(ten_models):
    events = []
    options = InferenceConfig(max_models_per_worker=5, idle_unload_s=0.2, intra_op_threads=1)
    reg = Registry(CpuDevice(), options, 1, ten_models.get, lambda m, e, ms, b, fps: events.append((m, e)), lambda: None)
    for name in ("m0", "m1"):
        _load(reg, name)
    reg.queued("m1")
    used = [state.last_used for state in reg.loaded.values()]   # the clock is the test's from here on
    reg.unload_idle(min(used) + 0.1)
    assert set(reg.loaded) == {"m0", "m1"}   # not idle long enough yet
    reg.unload_idle(max(used) + 1.0)
    assert set(reg.loaded) == {"m1"} and ("m0", "unloaded") in events
    reg.close()


def test_unload_during_a_load_drops_the_model_when_the_load_ends(ten_models):
    events = []
    reg = _registry(ten_models, events=events)
    assert reg.start_load("m0") and "m0" in reg.loading
    assert reg.unload("m0")
    reg.loading["m0"].result(60)
    reg.poll_loads()
    assert "m0" not in reg.loaded and events == [("m0", "loaded"), ("m0", "unloaded")]
    # A load asked for after the unload wins over it.
    assert reg.start_load("m1") and reg.unload("m1") and reg.start_load("m1")
    reg.loading["m1"].result(60)
    reg.poll_loads()
    assert "m1" in reg.loaded
    reg.close()


def test_room_is_made_before_a_load_starts_counting_the_loads_under_way(ten_models):
    """An idle model over the cap is evicted as the next load starts (on a card its memory is what the load
    needs), the loads under way counted against the cap; a model busy then is evicted once the load ends,
    if it is idle by then."""
    reg = _registry(ten_models, "lru", max_models=2)
    _load(reg, "m0")
    assert reg.start_load("m1") and reg.start_load("m2")   # m1 still loading (until polled)
    assert "m0" not in reg.loaded
    for name in ("m1", "m2"):
        reg.loading[name].result(60)
    reg.poll_loads()
    assert set(reg.loaded) == {"m1", "m2"}
    reg.queued("m1")
    reg.queued("m2")
    assert reg.start_load("m3")   # both busy: no room yet
    assert set(reg.loaded) == {"m1", "m2"}
    reg.finished("m1")
    reg.loading["m3"].result(60)
    reg.poll_loads()
    assert set(reg.loaded) == {"m2", "m3"}
    reg.close()


def test_pinned_models_stay_until_their_own_process_unpins_or_restarts_then_the_cap_holds_again(ten_models):
    """A live session pins its model (LoadModel pin): it is never evicted, the worker over its cap while
    every model is held. A process's unpin takes one of its own pins only, another process's pin of the
    model stays; a restarted process's pins go with its predecessor's request ids (drop_pins_below), and
    the models over the cap are evicted then."""
    from shm.requests import first_id
    one, two = first_id(1, 1000), first_id(2, 1000)
    reg = _registry(ten_models, "lru", max_models=2)
    for name in ("m0", "m1"):
        _load(reg, name)
    reg.pin("m0", one)
    reg.pin("m0", two)
    reg.pin("m1", two + 1)
    _load(reg, "m2")
    assert set(reg.loaded) == {"m0", "m1", "m2"}   # over the cap: both older models held
    reg.unpin("m0", one + 7)   # process one's session closes; process two's pin of m0 stays
    _load(reg, "m3")
    assert set(reg.loaded) == {"m0", "m1", "m3"}   # m2, idle, made room
    assert reg.drop_pins_below(first_id(2, 2000)) == 2   # process two restarted
    assert set(reg.loaded) == {"m1", "m3"}   # back within the cap at once: the least recently used went
    reg.close()


def test_the_devices_frames_per_s_is_its_slowest_loaded_architectures(ten_models):
    """Admission's frames/s (every model event carries it) is the lowest of the loaded runners' measured
    ones: a host holding a slow architecture beside a fast one is not sold the fast one's seats."""
    from types import SimpleNamespace
    from gpu_actor.registry import Loaded
    reg = _registry(ten_models)
    assert reg.frames_per_s() == 0.0
    reg.loaded = {"fast": Loaded(SimpleNamespace(frames_per_s=900.0), 1, 0.0),
                  "slow": Loaded(SimpleNamespace(frames_per_s=300.0), 1, 0.0),
                  "cpu": Loaded(SimpleNamespace(frames_per_s=0.0), 1, 0.0)}   # (not measured: left out)
    assert reg.frames_per_s() == 300.0
    reg.close()


@pytest.mark.parametrize("inputs, outputs, message", [
    ([("v", [1, 6, 320, 320]), ("a", [1, 32, 16, 16]), ("x", [1, 4])], [("o", [1, 3, 320, 320])], "expected 2 inputs"),
    ([("v", [1, 6, 320, 320]), ("a", [1, 32, 16, 16])], [("o", [1, 3, 320, 320]), ("p", [1])], "and 1 output"),
    ([("v", [1, 3, 320, 320]), ("a", [1, 32, 16, 16])], [("o", [1, 3, 320, 320])], r"no input of shape \[B,6,320,320\]"),
    ([("v", ["N", 6, 320, 320]), ("a", ["N", "T", 16, 16])], [("o", ["N", 3, 320, 320])],
     "audio input a must have a static shape after the batch dim"),
    ([("v", [1, 6, 320, 320]), ("a", [1, 32, 16, 16])], [("o", [1, 3, 256, 256])], r"output o must be \[B,3,320,320\]"),
    ([("v", [1, 6, 320, 320]), ("a", [4, 32, 16, 16])], [("o", [1, 3, 320, 320])],
     r"disagree on the batch size: \[1, 4\]"),
])
def test_a_models_inputs_and_outputs_that_do_not_fit_are_refused_saying_what_fits(inputs, outputs, message):
    """classify_io picks the visual and audio inputs by shape; a model that does not fit the contract is
    refused naming what it has and what is expected."""
    from config.assets import classify_io
    with pytest.raises(AssetError, match=message):
        classify_io(inputs, outputs, "m.onnx")
    io = classify_io([("audio", ["N", 32, 16, 16]), ("image", ["N", 6, 320, 320])], [("o", ["N", 3, 320, 320])], "m")
    assert (io.visual, io.audio, io.audio_shape, io.batch) == ("image", "audio", (32, 16, 16), None)
    assert classify_io([("v", [4, 6, 320, 320]), ("a", ["N", 32, 16, 16])], [("o", [4, 3, 320, 320])], "m").batch == 4


def test_model_io_is_read_without_decoding_weights_and_ignores_initializer_inputs(tmp_path):
    from onnx import helper
    model = build_model("tiny", "hubert", batch=4, visual_name="image")
    # Old exporters (IR < 4) list every weight among the graph inputs too.
    for init in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    path = tmp_path / "old.onnx"
    onnx.save(model, str(path))
    io = read_model_io(path)
    assert (io.visual, io.audio, io.audio_shape, io.batch) == ("image", "audio", (32, 32, 32), 4)


# -- the worker's audio encoders (gpu_actor/encoder.py) ------------------------------------------------

def _encoders(tmp_path: Path, max_batch: int = 8):
    """Two avatars' encoders, one file's content at two paths, on a device that batches at prepared
    sizes; the device's first-call stalls after the first avatar's."""
    from gpu_actor.device import StandInDevice
    from gpu_actor.encoder import AudioEncoders
    from gpu_actor.model_builder import write_audio_encoder
    device = StandInDevice(0.0)
    encoders = AudioEncoders(device, max_batch, 1, False)
    first = write_audio_encoder(tmp_path / "a" / "audio_encoder.onnx", seed=4)
    (tmp_path / "b").mkdir()
    second = tmp_path / "b" / "audio_encoder.onnx"
    second.write_bytes(first.read_bytes())
    encoders.load("a", first)
    stalls = device.stalls
    encoders.load("b", second)
    return device, encoders, stalls, first


def _encoded(path: Path, inputs: np.ndarray) -> np.ndarray:
    """The encoder file run alone on the CPU provider, one call."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: inputs})[0]


def test_avatars_whose_encoder_files_match_share_its_sessions_and_a_whole_utterance_pads_only_its_calls(tmp_path):
    """The second avatar's encoder (the same bytes at another path) meets no new session or shape; a whole
    utterance's PCM (an `infer` request's) runs in calls at prepared sizes, the last padded, and gives
    exactly its frames' windows: those of the file run alone on it."""
    from config import audio as A
    device, encoders, stalls, path = _encoders(tmp_path)
    assert stalls == len(device.sizes(8)) and device.stalls == stalls   # b loaded nothing of its own
    assert encoders.of("a") is encoders.of("b")
    pcm = np.round(A.speech(1.3, seed=2) * 32767).astype(np.int16)
    inputs = A.encoder_inputs(A.melspectrogram(pcm.astype(np.float32) / 32768.0))
    assert len(inputs) % 8 and len(inputs) > 8   # (so some call is padded)
    windows = encoders.windows("b", pcm)
    expected = A.frame_windows(_encoded(path, inputs))
    assert windows.shape == expected.shape == (A.frame_count(len(pcm)), 32, 16, 16)
    assert np.abs(windows - expected).max() <= 1e-5


def test_a_steps_encoder_inputs_run_in_one_call_each_encoded_once_and_kept_within_a_bound(tmp_path, monkeypatch):
    """`features_many` (a worker step's PCM tasks): the inputs of every session on one encoder run in one
    call, each (utterance, input number) once; a later step encodes only what is new; the least recently
    used go past the cache's bound; a task without an utterance is never kept."""
    from config import audio as A
    from gpu_actor import encoder as E
    _, encoders, _, path = _encoders(tmp_path)
    monkeypatch.setattr(E, "FEATURES_CACHE", 12)
    encoded: list[int] = []
    run = E.Encoder.run
    monkeypatch.setattr(E.Encoder, "run", lambda self, rows: (encoded.append(len(rows)), run(self, rows))[1])
    mel = A.encoder_inputs(A.melspectrogram(A.speech(1.0, seed=3)))
    reference = _encoded(path, mel)

    def step(*tasks: tuple[str, str, int, int]) -> None:   # (model, utterance, first input, inputs)
        results = encoders.features_many([(m, u, a, mel[a:a + n]) for m, u, a, n in tasks])
        for (_, _, a, n), got in zip(tasks, results):
            assert np.abs(got - reference[a:a + n]).max() <= 1e-5

    # two sessions on avatars sharing the encoder, one of them with two requests, and one uncached task
    step(("a", "u1", 0, 6), ("b", "u2", 0, 3), ("a", "u1", 4, 5), ("a", "", 0, 4))
    assert encoded == [9 + 3 + 4]   # one call: u1's inputs 0-8 once, u2's 0-2, the uncached task's 4
    assert len(encoders._features) == 12   # the uncached task's went
    step(("a", "u1", 0, 2), ("b", "u2", 3, 2))   # u1's 0-1 kept (and now used last); u2's 3-4 are new
    assert encoded[1:] == [2]
    # past the bound (12), the least recently used went: u1's 2 and 3, not its 0 and 1
    step(("a", "u1", 0, 2))
    assert encoded[2:] == []
    step(("a", "u1", 2, 2))
    assert encoded[2:] == [2]
