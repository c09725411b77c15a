"""Every model the CPU path serves, the GPU path serves with the same mouths: a table of small graphs, each
the visual and audio inputs and the [B,3,320,320] output around one feature of ONNX files that split_model
(gpu_actor/model_split.py) must carry into an architecture and its weights. Each is loaded both ways, in a
session of its own (gpu_actor/own_session.OwnSessionRunner) and in its architecture's prepared session with its weights
bound per call (gpu_actor/architectures.Architectures on the stand-in device), and run at batches 1, 3 and 4."""

from __future__ import annotations

import re
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from config.assets import AssetError
from gpu_actor.architectures import Architectures
from gpu_actor.device import StandInDevice
from gpu_actor.model_split import split_model
from gpu_actor.own_session import OwnSessionRunner
from gpu_actor.runner import Part
from gpu_actor.weights import Weights

BATCHES = (1, 3, 4)   # 3: padded to 4; 4: the largest prepared size
MAX_BATCH = 4
FEATURE_IN, FEATURE_OUT = "h", "y"   # what each case's nodes read and write


def _f32(rng: np.random.Generator, shape) -> np.ndarray:
    return np.asarray(rng.uniform(0.5, 1.5, shape), np.float32)


# -- the features under test: (nodes, initializers) from FEATURE_IN [B,3,320,320] to FEATURE_OUT ----------

def _mul(name: str, value: np.ndarray):
    return [helper.make_node("Mul", [FEATURE_IN, name], [FEATURE_OUT])], [numpy_helper.from_array(value, name)]


def _scalar(rng):   # x * 0.5 as torch exports it: a 0-d constant
    return _mul("half", _f32(rng, ()))


def _one_element(rng):
    return _mul("gain", _f32(rng, (1,)))


def _shared(rng):   # one weight, two nodes
    nodes = [helper.make_node("Add", [FEATURE_IN, "w"], ["h1"]), helper.make_node("Mul", ["h1", "w"], [FEATURE_OUT])]
    return nodes, [numpy_helper.from_array(_f32(rng, (3, 1, 1)), "w")]


def _integer_constants(rng):   # a Reshape's shape and a Slice's starts, ends and axes
    nodes = [helper.make_node("Reshape", [FEATURE_IN, "shape"], ["r"]),
             helper.make_node("Slice", ["r", "starts", "ends", "axes"], ["s"]),
             helper.make_node("Mul", ["s", "w"], [FEATURE_OUT])]
    ints = {"shape": [-1, 3, 320, 320], "starts": [0], "ends": [3], "axes": [1]}
    return nodes, [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()] + [
        numpy_helper.from_array(_f32(rng, (3, 1, 1)), "w")]


def _float16_weight(rng):   # an fp16 branch in an fp32 graph: its weight is bound as fp16
    nodes = [helper.make_node("Cast", [FEATURE_IN], ["h16"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["h16", "w16"], ["y16"]),
             helper.make_node("Cast", ["y16"], [FEATURE_OUT], to=TensorProto.FLOAT)]
    return nodes, [numpy_helper.from_array(_f32(rng, (3, 1, 1)).astype(np.float16), "w16")]


def _float16_cast(rng):   # an fp16 initializer cast to fp32 before use: a Cast's input stays a constant
    nodes = [helper.make_node("Cast", ["w16"], ["w"], to=TensorProto.FLOAT),
             helper.make_node("Add", [FEATURE_IN, "w"], [FEATURE_OUT])]
    return nodes, [numpy_helper.from_array(_f32(rng, (3, 1, 1)).astype(np.float16), "w16")]


def _gather_table(rng):   # a Gather's data: a constant of the graph, its value part of the architecture
    nodes = [helper.make_node("Gather", ["table", "index"], ["g"], axis=0),
             helper.make_node("Reshape", ["g", "g_shape"], ["g3"]),
             helper.make_node("Add", [FEATURE_IN, "g3"], [FEATURE_OUT])]
    return nodes, [numpy_helper.from_array(_f32(rng, (8,)), "table"),
                   numpy_helper.from_array(np.array([5, 0, 2], np.int64), "index"),
                   numpy_helper.from_array(np.array([3, 1, 1], np.int64), "g_shape")]


def _empty_weight(rng):   # a 0-byte weight (shape [0]) that feeds an Add: 0 bytes in the weights' buffer
    nodes = [helper.make_node("Add", ["empty", "empty"], ["e"]),
             helper.make_node("Concat", ["e", "bias"], ["c"], axis=0),
             helper.make_node("Reshape", ["c", "c_shape"], ["c3"]),
             helper.make_node("Add", [FEATURE_IN, "c3"], [FEATURE_OUT])]
    return nodes, [numpy_helper.from_array(np.zeros((0,), np.float32), "empty"),
                   numpy_helper.from_array(np.array([0.1, -0.2, 0.3], np.float32), "bias"),   # a Concat's: a constant
                   numpy_helper.from_array(np.array([3, 1, 1], np.int64), "c_shape")]


def _model(feature: Callable, seed: int, opset: int = 13, ir_version: int = 7, outputs: tuple = ()) -> onnx.ModelProto:
    """sigmoid(feature(1x1 conv(visual) + mean(audio))), dynamic batch; `outputs`: more graph outputs."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["visual", "conv.w", "conv.b"], ["x"]),
             helper.make_node("ReduceMean", ["audio"], ["a"], axes=[1, 2, 3], keepdims=1),
             helper.make_node("Add", ["x", "a"], [FEATURE_IN])]
    inits = [numpy_helper.from_array(np.asarray(rng.normal(0, 0.5, (3, 6, 1, 1)), np.float32), "conv.w"),
             numpy_helper.from_array(np.asarray(rng.normal(0, 0.1, (3,)), np.float32), "conv.b")]
    more_nodes, more_inits = feature(rng)
    nodes += [*more_nodes, helper.make_node("Sigmoid", [FEATURE_OUT], ["out"])]
    graph = helper.make_graph(
        nodes, "case", [helper.make_tensor_value_info("visual", TensorProto.FLOAT, ["B", 6, 320, 320]),
                        helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["B", 32, 16, 16])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", 3, 320, 320]), *outputs], inits + more_inits)
    if ir_version < 4:   # every initializer also a graph input, as IR version 3 requires
        graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    onnx.checker.check_model(model)
    return model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path


def _save_external(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    assert (path.parent / "model.onnx.data").exists()
    return path


# name -> (the model of a seed, how it is saved, the weights its architecture binds)
CASES = {
    "scalar": (lambda seed: _model(_scalar, seed), _save, {"half": ()}),
    "one_element": (lambda seed: _model(_one_element, seed), _save, {"gain": (1,)}),
    "shared": (lambda seed: _model(_shared, seed), _save, {"w": (3, 1, 1)}),
    "integer_constants": (lambda seed: _model(_integer_constants, seed), _save, {"w": (3, 1, 1)}),
    "initializers_as_inputs": (lambda seed: _model(_shared, seed, opset=8, ir_version=3), _save, {"w": (3, 1, 1)}),
    "external_data": (lambda seed: _model(_scalar, seed), _save_external, {"half": ()}),
    "float16_weight": (lambda seed: _model(_float16_weight, seed), _save, {"w16": (3, 1, 1)}),
    "float16_cast": (lambda seed: _model(_float16_cast, seed), _save, {}),
    "gather_table": (lambda seed: _model(_gather_table, seed), _save, {}),
    "empty_weight": (lambda seed: _model(_empty_weight, seed), _save, {"empty": (0,)}),
}
CONV = {"conv.w": (3, 6, 1, 1), "conv.b": (3,)}


def _inputs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.random((n, 6, 320, 320), dtype=np.float32),
            rng.standard_normal((n, 32, 16, 16)).astype(np.float32))


def _mouths(runner, n: int) -> np.ndarray:
    out = np.full((n, 3, 320, 320), np.nan, np.float32)
    runner.run(*_inputs(n, seed=n), out)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_model_the_cpu_path_serves_the_gpu_path_serves_with_the_same_mouths(tmp_path, case):
    build, save, weights = CASES[case]
    path = save(build(1), tmp_path / case / "model.onnx")
    architecture = split_model(path).architecture
    assert dict(zip(architecture.weights, architecture.shapes)) == {**CONV, **weights}
    cpu = OwnSessionRunner(path)
    gpu = Architectures(StandInDevice(0.0), MAX_BATCH, 0, False).load(path, case)
    for n in BATCHES:
        want = _mouths(cpu, n)
        assert np.isfinite(want).all()
        np.testing.assert_allclose(_mouths(gpu, n), want, rtol=0, atol=1e-5, err_msg=f"{case}, batch {n}")


@pytest.mark.parametrize("case", ["scalar", "one_element", "shared", "float16_weight", "empty_weight"])
def test_two_models_of_one_graph_share_its_session_each_with_its_own_weights(tmp_path, case):
    build, save, _ = CASES[case]
    paths = [save(build(seed), tmp_path / f"{case}{seed}" / "model.onnx") for seed in (1, 2)]
    archs = Architectures(StandInDevice(0.0), MAX_BATCH, 0, False)
    runners = [archs.load(path, f"{case}{k}") for k, path in enumerate(paths)]
    assert len(archs.prepared) == 1 and runners[0].prepared is runners[1].prepared
    got = [[_mouths(runner, n) for n in BATCHES] for runner in runners]
    for path, mouths in zip(paths, got):
        cpu = OwnSessionRunner(path)
        for n, batch in zip(BATCHES, mouths):
            np.testing.assert_allclose(batch, _mouths(cpu, n), rtol=0, atol=1e-5)
    assert not any(np.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(*got)), "one model's weights served both"


def test_a_constant_the_graph_reads_at_creation_keeps_models_with_other_values_apart(tmp_path):
    """A Gather's table is part of the architecture (its key hashes the value): two models with other
    tables get two sessions, each serving its own."""
    build, save, _ = CASES["gather_table"]
    paths = [save(build(seed), tmp_path / f"g{seed}" / "model.onnx") for seed in (1, 2)]
    archs = Architectures(StandInDevice(0.0), MAX_BATCH, 0, False)
    runners = [archs.load(path, f"g{k}") for k, path in enumerate(paths)]
    assert len(archs.prepared) == 2
    for path, runner in zip(paths, runners):
        np.testing.assert_allclose(_mouths(runner, 3), _mouths(OwnSessionRunner(path), 3), rtol=0, atol=1e-5)


def test_a_weight_that_is_also_a_graph_output_is_refused_on_both_paths_for_its_second_output(tmp_path):
    """classify_io takes one output: the CPU path refuses the file, and the GPU path refuses its architecture
    alike, before it runs (a weight named like a canonical tensor, t..., broke the split itself)."""
    for name in ("w", "tw"):
        def feature(rng, name=name):
            return _mul(name, _f32(rng, (3, 1, 1)))
        path = _save(_model(feature, 1, outputs=(helper.make_tensor_value_info(name, TensorProto.FLOAT, [3, 1, 1]),)),
                     tmp_path / name / "model.onnx")
        extra = re.escape(f"('{name}', [3, 1, 1])")
        with pytest.raises(AssetError, match=f"and 1 output, found .*{extra}"):
            OwnSessionRunner(path)
        device = StandInDevice(0.0)
        with pytest.raises(AssetError, match=f"and 1 output, found .*{extra}"):
            Architectures(device, MAX_BATCH, 0, False).load(path, name)
        assert device.stalls == 0, "a size was prepared for a file that cannot serve"


def test_a_weight_its_architecture_does_not_take_names_the_file_once(tmp_path):
    """Architecture.weights_of's error starts with what the caller names (the model's file, as every load
    error does): whoever reports it adds the model's id, once."""
    def one_element_half(rng):
        return _mul("half", _f32(rng, (1,)))
    scalar = split_model(_save(_model(_scalar, 1), tmp_path / "scalar" / "model.onnx"))
    path = _save(_model(one_element_half, 1), tmp_path / "one" / "model.onnx")
    with pytest.raises(AssetError) as err:
        scalar.architecture.weights_of(str(path), split_model(path))
    assert str(err.value) == f"{path}: weight half is [1], its architecture needs []"
    assert [w.shape for w in scalar.architecture.weights_of(str(path), scalar)] == [(3, 6, 1, 1), (3,), ()]


def test_a_weights_buffer_holds_0_d_and_0_byte_tensors_in_their_shapes(tmp_path):
    """gpu_actor/weights.Weights: a 0-d tensor takes one element, a 0-byte one none (here at the offset of
    the next), each view in its architecture's shape (a GPU's upload copies only into the very same shape)."""
    path = _save(_model(lambda rng: _chain(rng, _empty_weight, _scalar), 1), tmp_path / "m" / "model.onnx")
    split = split_model(path)
    assert [w.shape for w in split.weights] == list(split.architecture.shapes) == [(3, 6, 1, 1), (3,), (0,), ()]
    assert all(w.flags.c_contiguous for w in split.weights)
    weights = Weights(StandInDevice(0.0), split.architecture, split.weights)
    for view, array in zip(weights.views, split.weights):
        assert view.shape == array.shape and view.dtype == array.dtype
        np.testing.assert_array_equal(view, array)


def test_a_0_d_weight_uploads_to_a_gpu_in_its_own_shape(tmp_path):
    """cupy's ndarray.set copies only from an array of the very same shape, and so does the stand-in's
    upload: a 0-d weight goes up 0-d, not as numpy's ascontiguousarray makes it ([1])."""
    path = _save(_model(_scalar, 1), tmp_path / "scalar" / "model.onnx")
    runner = Architectures(StandInDevice(0.0), MAX_BATCH, 0, False).load(path, "scalar")
    np.testing.assert_allclose(_mouths(runner, 3), _mouths(OwnSessionRunner(path), 3), rtol=0, atol=1e-5)


def _chain(rng, *features):
    """Features one after another: FEATURE_IN -> ... -> FEATURE_OUT, their tensors renamed apart."""
    nodes, inits, current = [], [], FEATURE_IN
    for k, feature in enumerate(features):
        more_nodes, more_inits = feature(rng)
        rename = {t.name: f"{t.name}.{k}" for t in more_inits}
        for node in more_nodes:
            rename.update({o: f"{o}.{k}" for o in node.output})
        rename[FEATURE_IN] = current
        for node in more_nodes:
            node.input[:] = [rename.get(i, i) for i in node.input]
            node.output[:] = [rename[o] for o in node.output]
        for t in more_inits:
            t.name = rename[t.name]
        current = rename[FEATURE_OUT]
        nodes += more_nodes
        inits += more_inits
    nodes.append(helper.make_node("Identity", [current], [FEATURE_OUT]))
    return nodes, inits


# (gather_table, float16_cast: their seeds' constants differ, so they are two architectures: never one step)
@pytest.mark.parametrize("case", sorted(set(CASES) - {"gather_table", "float16_cast", "empty_weight"}))
def test_a_grouped_step_of_several_models_gives_each_frame_its_own_models_mouths(tmp_path, case):
    """A step holding frames of several models of one graph, in one call of its N-model form
    (gpu_actor/mixed.py): each part's mouths are its own model's, with a model twice and padding (5
    frames at size 8); fp32 graphs' weights go as whole buffers (one packed input), the fp16 case's as
    one stacked input per weight."""
    build, save, _ = CASES[case]
    paths = [save(build(seed), tmp_path / f"{case}{seed}" / "model.onnx") for seed in (1, 2)]
    archs = Architectures(StandInDevice(0.0), 8, 0, False, mixed="grouped")
    runners = [archs.load(path, f"{case}{k}") for k, path in enumerate(paths)]
    archs.prepare_more(weakref.ref(runners[1]))
    prepared = runners[0].prepared
    assert runners[1].prepared is prepared
    assert prepared.grouped is not None and prepared.grouped.packed == (case != "float16_weight")
    rows = (2, 1, 2)   # models 0, 1, 0
    inputs = [_inputs(n, seed=10 + k) for k, n in enumerate(rows)]
    outs = [np.full((n, 3, 320, 320), np.nan, np.float32) for n in rows]
    parts = [Part(v, a, o) for (v, a), o in zip(inputs, outs)]
    assert prepared.prefers_grouped([4, 1])
    prepared.run_grouped([(runners[0], [parts[0], parts[2]]), (runners[1], [parts[1]])])
    assert prepared.call_stats()["steps"] == {} and prepared.calls == {8: 1}
    for k, ((visual, audio), out) in enumerate(zip(inputs, outs)):
        want = np.empty_like(out)
        OwnSessionRunner(paths[(0, 1, 0)[k]]).run(visual, audio, want)
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5, err_msg=f"{case}: part {k}")
    # the next step's rows hold the models the other way round: each row's weights are copied again
    for out in outs:
        out[:] = np.nan
    prepared.run_grouped([(runners[1], [parts[0], parts[2]]), (runners[0], [parts[1]])])
    for k, ((visual, audio), out) in enumerate(zip(inputs, outs)):
        want = np.empty_like(out)
        OwnSessionRunner(paths[(1, 0, 1)[k]]).run(visual, audio, want)
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5, err_msg=f"{case}: part {k}, second step")


def test_a_graph_the_n_model_form_cannot_express_runs_its_mixed_steps_as_a_call_per_model(tmp_path, caplog):
    """A 0-byte weight added to the features is data the form refuses (gpu_actor/grouped.py names the
    node): the architecture serves, and its steps of several models are sub-calls."""
    build, save, _ = CASES["empty_weight"]
    paths = [save(build(seed), tmp_path / f"e{seed}" / "model.onnx") for seed in (1, 2)]
    archs = Architectures(StandInDevice(0.0), 8, 0, False, mixed="grouped")
    runners = [archs.load(path, f"e{k}") for k, path in enumerate(paths)]
    archs.prepare_more(weakref.ref(runners[1]))
    assert runners[0].prepared.grouped is None and not runners[0].prepared.prefers_grouped([1, 1])
    assert "run one call per model" in caplog.text and "Add node" in caplog.text
    np.testing.assert_allclose(_mouths(runners[1], 3), _mouths(OwnSessionRunner(paths[1]), 3), rtol=0, atol=1e-5)
