"""gpu_actor/grouped.py: one call, frame i with model i's weights, equals model i run alone on frame i;
graphs that would mix frames are refused by node. CPU provider; the device's timings: bench/grouped.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gpu_actor.grouped import GroupError, grouped_graph, stacked_feeds
from gpu_actor.model_builder import AUDIO_SHAPES, build_model
from gpu_actor.model_split import split_proto
from gpu_actor.precision import to_fp16

TOLERANCE = 1e-5


def _session(graph: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def _splits(kind: str, audio: str, seeds) -> list:
    return [split_proto(build_model(kind=kind, audio=audio, seed=s), Path(f"{kind}-{s}.onnx")) for s in seeds]


def _frames(n: int, audio: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.random((n, 6, 320, 320), dtype=np.float32),
            rng.standard_normal((n, *AUDIO_SHAPES[audio])).astype(np.float32))


def _alone(splits, rows, visual, audio) -> np.ndarray:
    """Each frame through its own model, one frame a call (the architecture's session, weights bound)."""
    architecture = splits[0].architecture
    session = _session(architecture.graph)
    return np.concatenate([session.run(None, {"input": visual[i:i + 1], "audio": audio[i:i + 1],
                                              **dict(zip(architecture.weights, splits[m].weights))})[0]
                           for i, m in enumerate(rows)])


def _grouped(splits, rows, visual, audio, pointwise: str) -> np.ndarray:
    architecture = splits[0].architecture
    graph = grouped_graph(architecture, len(rows), pointwise)
    feeds = stacked_feeds(architecture, [splits[m].weights for m in rows])
    return _session(graph).run(None, {"input": visual, "audio": audio, **feeds})[0]


def _mixed_batch(splits, audio: str):
    """Rows: every model once, the first again, and a padded row (zeros) with the last model's weights."""
    rows = [*range(len(splits)), 0, len(splits) - 1]
    visual, features = _frames(len(rows), audio)
    visual[-1], features[-1] = 0, 0
    return rows, visual, features


@pytest.fixture(scope="module")
def unet():
    splits = _splits("unet328", "ave", (1, 2))
    rows, visual, audio = _mixed_batch(splits, "ave")
    return splits, rows, visual, audio, _alone(splits, rows, visual, audio)


@pytest.mark.parametrize("pointwise", ["conv", "matmul"])
def test_each_frame_of_a_grouped_call_is_what_its_own_model_computes_alone_tiny(pointwise):
    splits = _splits("tiny", "ave", (1, 2, 3))
    assert len({s.architecture.key for s in splits}) == 1
    rows, visual, audio = _mixed_batch(splits, "ave")
    expected = _alone(splits, rows, visual, audio)
    got = _grouped(splits, rows, visual, audio, pointwise)
    assert got.shape == expected.shape == (len(rows), 3, 320, 320)
    assert np.abs(got - expected).max() <= TOLERANCE


@pytest.mark.parametrize("pointwise", ["conv", "matmul"])
def test_each_frame_of_a_grouped_call_is_what_its_own_model_computes_alone_unet328(unet, pointwise):
    splits, rows, visual, audio, expected = unet
    got = _grouped(splits, rows, visual, audio, pointwise)
    for i in range(len(rows)):
        assert np.abs(got[i] - expected[i]).max() <= TOLERANCE, f"frame {i} (model {rows[i]}), {pointwise}"
    # the models differ enough that a frame run with the other model's weights could not pass
    assert np.abs(expected[0] - _alone(splits, [1], visual[:1], audio[:1])[0]).max() > 1e-3


@pytest.mark.parametrize("kind, audio, pointwise", [("tiny", "hubert", "conv"), ("tiny", "wenet", "matmul"),
                                                    ("unet328", "hubert", "conv"), ("unet328", "wenet", "matmul")])
def test_the_hubert_and_wenet_variants_group_too(kind, audio, pointwise):
    splits = _splits(kind, audio, (1, 2))
    rows = [0, 1]
    visual, features = _frames(2, audio, seed=1)
    expected = _alone(splits, rows, visual, features)
    assert np.abs(_grouped(splits, rows, visual, features, pointwise) - expected).max() <= TOLERANCE


def test_a_model_of_a_fixed_batch_of_1_groups_at_any_n():
    splits = [split_proto(build_model(kind="tiny", batch=1, seed=s), Path(f"fixed-{s}.onnx")) for s in (1, 2, 3)]
    visual, audio = _frames(3, "ave")
    expected = _alone(splits, [0, 1, 2], visual, audio)
    assert np.abs(_grouped(splits, [0, 1, 2], visual, audio, "conv") - expected).max() <= TOLERANCE


def test_the_graph_takes_each_weight_stacked_by_its_own_name_and_the_data_at_batch_n():
    architecture = _splits("tiny", "ave", (1,))[0].architecture
    model = onnx.load_from_string(grouped_graph(architecture, 5, "matmul"))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*model.graph.input,
                                                                                    *model.graph.output)}
    assert shapes == {"input": [5, 6, 320, 320], "audio": [5, 32, 16, 16], "output": [5, 3, 320, 320],
                      **{w: [5, *s] for w, s in zip(architecture.weights, architecture.shapes)}}
    assert model.opset_import[0].version == 11


def test_weights_swapped_between_frames_give_each_frame_the_other_models_output():
    splits = _splits("tiny", "ave", (1, 2))
    visual, audio = _frames(2, "ave")
    expected = _alone(splits, [0, 1], visual, audio)
    swapped = _grouped(splits, [1, 0], visual, audio, "conv")
    assert np.abs(swapped - expected).max() > 1e-3
    assert np.abs(swapped - _alone(splits, [1, 0], visual, audio)).max() <= TOLERANCE


def test_an_fp16_architecture_keeps_its_types():
    splits = [split_proto(to_fp16(build_model(kind="tiny", seed=s))[0], Path(f"half-{s}.onnx")) for s in (1, 2)]
    architecture = splits[0].architecture
    assert set(architecture.dtypes) == {np.dtype(np.float16)}
    model = onnx.load_from_string(grouped_graph(architecture, 2))
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    assert all(types[w] == TensorProto.FLOAT16 for w in architecture.weights)
    visual, audio = _frames(2, "ave")
    expected = _alone(splits, [0, 1], visual, audio)
    assert np.abs(_grouped(splits, [0, 1], visual, audio, "conv") - expected).max() <= 1e-3   # fp16's rounding


def test_stacked_feeds_names_the_model_and_weight_of_another_shape():
    splits = _splits("tiny", "ave", (1,))
    weights = list(splits[0].weights)
    weights[0] = weights[0][:1]
    with pytest.raises(ValueError, match=r"model 1's weight tiny\.weight is \[1, 6, 1, 1\]"):
        stacked_feeds(splits[0].architecture, [splits[0].weights, weights])


# -- every weight op the transform rewrites, in a graph of opset 17 (axes as inputs) ----------------------------

def _zoo(seed: int) -> onnx.ModelProto:
    """x [B, 4, 6, 6] through each weight op: grouped, 1x1 and transposed convolutions, batch, instance and
    layer norm, PRelu, Mul / Sub / Div by weights (a scalar among them), MatMul with the weight on either
    side and as a vector, Gemm with transB, alpha, beta and C; Unsqueeze / Squeeze / Flatten between."""
    rng = np.random.default_rng(seed)
    inits = []

    def w(name: str, *shape: int, low: float = -0.5, high: float = 0.5) -> str:
        inits.append(numpy_helper.from_array(rng.uniform(low, high, shape).astype(np.float32), name))
        return name

    def i64(name: str, values) -> str:
        inits.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    node = helper.make_node
    nodes = [
        node("Conv", ["x", w("c1", 8, 2, 3, 3), w("c1b", 8)], ["y1"], group=2, pads=[1, 1, 1, 1]),
        node("Conv", ["y1", w("p1", 8, 8, 1, 1), w("p1b", 8)], ["y2"]),
        node("BatchNormalization", ["y2", w("bs", 8), w("bb", 8), w("bm", 8), w("bv", 8, low=0.5, high=2)], ["y3"]),
        node("PRelu", ["y3", w("slope", 8, 1, 1)], ["y4"]),
        node("ConvTranspose", ["y4", w("t1", 8, 2, 2, 2), w("t1b", 4)], ["y5"], group=2, strides=[2, 2]),
        node("InstanceNormalization", ["y5", w("is", 4), w("ib", 4)], ["y6"]),
        node("Mul", ["y6", w("m", 4, 1, 1)], ["y7"]),
        node("Sub", [w("s", 1, 4, 1, 1), "y7"], ["y8"]),
        node("Div", ["y8", w("d", low=1, high=2)], ["y9"]),
        node("Reshape", ["y9", i64("shape", [0, 4, 144])], ["y10"]),
        node("MatMul", ["y10", w("mm", 144, 10, low=-0.1, high=0.1)], ["y11"]),
        node("MatMul", [w("ma", 5, 4), "y11"], ["y12"]),
        node("Unsqueeze", ["y12", i64("ax", [2])], ["y13"]),
        node("MatMul", ["y13", w("mb", 1, 10, 6)], ["y14"]),     # a weight with a batch axis of 1
        node("Squeeze", ["y14", "ax"], ["y15"]),
        node("Flatten", ["y15"], ["y16"], axis=1),
        node("Gemm", ["y16", w("g", 7, 30), w("gc", 7)], ["y17"], transB=1, alpha=0.5, beta=2.0),
        node("LayerNormalization", ["y17", w("ls", 7), w("lb", 7)], ["y18"], axis=-1),
        node("Gemm", ["y18", w("h", 7, 3)], ["y19"]),
        node("MatMul", ["y19", w("v", 3)], ["out"]),
    ]
    graph = helper.make_graph(nodes, "zoo", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4, 6, 6])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("pointwise", ["conv", "matmul"])
def test_every_weight_op_groups_exactly(pointwise):
    splits = [split_proto(_zoo(seed), Path(f"zoo-{seed}.onnx")) for seed in (1, 2, 3)]
    architecture = splits[0].architecture
    assert "shape" not in architecture.weights and len(architecture.weights) == 25
    x = np.random.default_rng(0).standard_normal((4, 4, 6, 6)).astype(np.float32)
    rows = [0, 1, 2, 0]
    alone = _session(architecture.graph)
    expected = np.concatenate([alone.run(None, {"x": x[i:i + 1], **dict(zip(architecture.weights,
                                                                            splits[m].weights))})[0]
                               for i, m in enumerate(rows)])
    graph = grouped_graph(architecture, len(rows), pointwise)
    got = _session(graph).run(None, {"x": x, **stacked_feeds(architecture, [splits[m].weights for m in rows])})[0]
    assert np.abs(got - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())
    assert np.abs(expected[0] - expected[1]).max() > 1e-3


def _rowwise(seed: int) -> onnx.ModelProto:
    """Ops between weight ops that keep frames apart, kept as they are: transposes, softmax, pad, pooling,
    concat, slices (the whole frames' axis among them), gather, and a Resize and a Reshape to [B, -1] whose
    sizes are computed from Shape, as torch.onnx.export writes them (opset 13: axes as inputs)."""
    rng = np.random.default_rng(seed)
    node = helper.make_node
    inits = [numpy_helper.from_array(rng.uniform(-1, 1, (4, 3, 3, 3)).astype(np.float32), "cw"),
             numpy_helper.from_array(rng.uniform(-1, 1, 4).astype(np.float32), "cb"),
             numpy_helper.from_array(rng.uniform(1, 2, (1,)).astype(np.float32), "scale"),
             _int64("pads", [0, 0, 1, 1, 0, 0, 1, 1]), _int64("starts", [0, 0]), _int64("ends", [2 ** 63 - 1, 5]),
             _int64("axes", [0, 1]), _int64("order", [2, 0, 1]), _int64("zero", [0]), _int64("minus", [-1]),
             _int64("two", [2]), _int64("eight", [8, 8])]
    nodes = [
        node("Conv", ["x", "cw", "cb"], ["h0"], pads=[1, 1, 1, 1]),
        node("Shape", ["h0"], ["h0_shape"]),
        node("Slice", ["h0_shape", "zero", "two"], ["h0_nc"]),
        node("Concat", ["h0_nc", "eight"], ["sizes"], axis=0),
        node("Resize", ["h0", "", "", "sizes"], ["up"], mode="nearest"),
        node("AveragePool", ["up"], ["h"], kernel_shape=[2, 2], strides=[2, 2]),
        node("Transpose", ["h"], ["t"], perm=[0, 2, 3, 1]),
        node("Softmax", ["t"], ["sm"], axis=-1),
        node("Transpose", ["sm"], ["tb"], perm=[0, 3, 1, 2]),
        node("Pad", ["tb", "pads"], ["p"]),
        node("MaxPool", ["p"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
        node("Concat", ["mp", "mp"], ["cat"], axis=1),
        node("Slice", ["cat", "starts", "ends", "axes"], ["sl"]),
        node("Gather", ["sl", "order"], ["g"], axis=1),
        node("Shape", ["g"], ["shape"]),
        node("Gather", ["shape", "zero"], ["batch"], axis=0),
        node("Concat", ["batch", "minus"], ["flat"], axis=0),
        node("Reshape", ["g", "flat"], ["r"]),
        node("Mul", ["r", "scale"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "rowwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, 4, 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", 27])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    onnx.checker.check_model(model, full_check=True)
    return model


def test_ops_that_keep_frames_apart_stay_as_they_are_between_weight_ops():
    splits = [split_proto(_rowwise(seed), Path(f"rowwise-{seed}.onnx")) for seed in (1, 2)]
    architecture = splits[0].architecture
    assert architecture.weights == ("cw", "cb", "scale")
    x = np.random.default_rng(0).standard_normal((3, 3, 4, 4)).astype(np.float32)
    rows = [0, 1, 1]
    alone = _session(architecture.graph)
    expected = np.concatenate([alone.run(None, {"x": x[i:i + 1], **dict(zip(architecture.weights,
                                                                            splits[m].weights))})[0]
                               for i, m in enumerate(rows)])
    graph = grouped_graph(architecture, len(rows))
    got = _session(graph).run(None, {"x": x, **stacked_feeds(architecture, [splits[m].weights for m in rows])})[0]
    assert got.shape == (3, 27) and np.abs(got - expected).max() <= TOLERANCE


# -- refusals ----------------------------------------------------------------------------------------------

def _small(*nodes, shape=("B", 3, 4, 4), out=("B", 3, 4, 4), opset: int = 11, inits=()) -> onnx.ModelProto:
    conv = helper.make_node("Conv", ["x", "cw", "cb"], ["h"], name="conv")
    weights = [numpy_helper.from_array(np.ones((3, 3, 1, 1), np.float32), "cw"),
               numpy_helper.from_array(np.zeros(3, np.float32), "cb")]
    graph = helper.make_graph([conv, *nodes], "small",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out))], [*weights, *inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model


def _int64(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


_REFUSED = {
    "reduce over the frames": (
        _small(helper.make_node("ReduceMean", ["h"], ["m"], name="mix", axes=[0], keepdims=1),
               helper.make_node("Add", ["h", "m"], ["y"], name="add")),
        r"ReduceMean node 'mix': it reduces along axis 0"),
    "reshape merging the frames": (
        _small(helper.make_node("Reshape", ["h", "merged"], ["r"], name="merge"),
               helper.make_node("Reshape", ["r", "back"], ["y"], name="back"),
               inits=[_int64("merged", [1, -1, 4, 4]), _int64("back", [-1, 3, 4, 4])]),
        r"Reshape node 'merge': r is \[1, 9, 4, 4\] at batch 3"),
    "a reshape to a constant batch that equals n": (
        _small(helper.make_node("Reshape", ["h", "fixed"], ["y"], name="fixed_batch"),
               inits=[_int64("fixed", [3, 3, 4, 4])]),
        r"Reshape node 'fixed_batch': y is \[3, 3, 4, 4\] at batch 3 and \[3, 3, 4, 4\] at batch 4"),
    "a transpose moving the frames": (
        _small(helper.make_node("Transpose", ["h"], ["t"], name="swap", perm=[1, 0, 2, 3]),
               helper.make_node("Transpose", ["t"], ["y"], name="back", perm=[1, 0, 2, 3])),
        r"Transpose node 'swap': perm \[1, 0, 2, 3\] moves the frames' axis"),
    "a slice of the frames": (
        _small(helper.make_node("Slice", ["h", "s0", "s1", "s2"], ["y"], name="cut"),
               inits=[_int64("s0", [1]), _int64("s1", [2 ** 62]), _int64("s2", [0])]),
        r"Slice node 'cut': it slices the frames' axis \(1:"),
    "squeeze without axes": (
        _small(helper.make_node("Squeeze", ["h"], ["y"], name="squeeze")),
        r"Squeeze node 'squeeze': its axes are not a constant"),
    "softmax over the frames (opset 13)": (
        _small(helper.make_node("Softmax", ["h"], ["y"], name="soft", axis=0), opset=13),
        r"Softmax node 'soft': it acts along axis 0"),
    "concat along the frames": (
        _small(helper.make_node("Concat", ["h", "h"], ["c"], name="cat", axis=0),
               helper.make_node("Slice", ["c", "s0", "s1", "s2"], ["y"], name="cut"),
               inits=[_int64("s0", [0]), _int64("s1", [1]), _int64("s2", [0])], out=(1, 3, 4, 4)),
        r"Concat node 'cat': it acts along axis 0"),
    "a weight used as plain data": (
        _small(helper.make_node("Add", ["w1", "w2"], ["ww"], name="weights_only"),
               helper.make_node("Add", ["h", "ww"], ["y"], name="add"),
               inits=[numpy_helper.from_array(np.ones((3, 1, 1), np.float32), "w1"),
                      numpy_helper.from_array(np.ones((3, 1, 1), np.float32), "w2")]),
        r"Add node 'weights_only': weight w1 is used as plain data"),
    "a weight with the frames' axis": (
        _small(helper.make_node("Mul", ["h", "per_batch"], ["y"], name="scale"),
               inits=[numpy_helper.from_array(np.ones((3, 3, 1, 1), np.float32), "per_batch")]),
        r"Mul node 'scale': weight per_batch \[3, 3, 1, 1\] has an axis in line with the frames'"),
    "a spatial size unknown": (
        _small(helper.make_node("Relu", ["h"], ["y"], name="relu"), shape=("B", 3, "H", 4), out=("B", 3, "H", 4)),
        r"input x: the shape of x is not static"),
    "the batch size used as data": (
        _small(helper.make_node("Shape", ["h"], ["s"], name="shape"),
               helper.make_node("Cast", ["s"], ["f"], name="cast", to=TensorProto.FLOAT),
               helper.make_node("ReduceSum", ["f"], ["t"], name="total", keepdims=0),
               helper.make_node("Add", ["h", "t"], ["y"], name="bias")),
        r"Add node 'bias': its input 1 \(t\) is computed from the batch size"),
}


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_a_graph_that_mixes_frames_is_refused_naming_the_node(case):
    model, message = _REFUSED[case]
    architecture = split_proto(model, Path("small.onnx")).architecture
    with pytest.raises(GroupError, match=message):
        grouped_graph(architecture, 3)


def test_the_bench_runs_on_the_cpu_and_skips_a_size_that_would_not_fit_its_budget(tmp_path, capsys):
    from bench.grouped import main
    assert main(["--device", "cpu", "--model", "tiny", "--sizes", "1,2,4096", "--seconds", "0.05",
                 "--budget-s", "30", "--json", str(tmp_path / "grouped.json")]) == 0
    figures = json.loads((tmp_path / "grouped.json").read_text())["grouped"]
    assert sorted(figures["sizes"]) == ["1", "2"] and list(figures["skipped"]) == ["4096"]
    for size in figures["sizes"].values():
        assert size["conv_max_abs_diff"] <= TOLERANCE and size["matmul_max_abs_diff"] <= TOLERANCE
        assert {"one", "conv", "matmul", "split"} <= set(size) and size["conv"]["ratio"] > 0
    assert "n=4096: skipped, estimated" in capsys.readouterr().out


def test_arguments_out_of_range_are_named():
    architecture = _splits("tiny", "ave", (1,))[0].architecture
    with pytest.raises(ValueError, match="n is the frames"):
        grouped_graph(architecture, 0)
    with pytest.raises(ValueError, match="pointwise must be one of"):
        grouped_graph(architecture, 2, "gemm")
