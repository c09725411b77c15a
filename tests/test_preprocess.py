"""The visual input built by the model's own graph (gpu_actor/preprocess.py) and inference.precision
(gpu_actor/precision.py), on the CPU provider with the worker's session options."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from config.assets import AssetError
from gpu_actor.model_builder import AUDIO_SHAPES, build_model, write_model
from gpu_actor.precision import CPU_FP16_ERROR, check_precision, to_fp16
from gpu_actor.preprocess import CROPS_INPUT, VISUAL_OUTPUT, visual_graph, with_visual_input
from gpu_actor.runner import make_session
from gpu_actor.visual import build_visual


def _session(model: onnx.ModelProto, path):
    onnx.save(model, str(path))
    return make_session(path, "cpu", threads=2)


def _crops(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 328, 328, 3), dtype=np.uint8)


def _reference(crops: np.ndarray) -> np.ndarray:
    out = np.empty((len(crops), 6, 320, 320), np.float32)
    build_visual(list(crops), out)
    return out


def _elem_types(values) -> list[int]:
    return [v.type.tensor_type.elem_type for v in values]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_graph_builds_build_visuals_input_to_the_bit(tmp_path, batch):
    session = _session(visual_graph(), tmp_path / "visual.onnx")
    crops = _crops(batch, seed=batch)
    crops[0, 4:324, 4:324] = np.arange(320 * 320 * 3).reshape(320, 320, 3) % 256   # every uint8 value
    got = session.run([VISUAL_OUTPUT], {CROPS_INPUT: crops})[0]
    want = _reference(crops)
    assert got.shape == (batch, 6, 320, 320) and got.dtype == np.float32
    # the same bits, not merely equal values (0.0 and -0.0 compare equal)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_graph_needs_opset_11():
    assert visual_graph(17).opset_import[0].version == 17
    with pytest.raises(ValueError, match="opset >= 11, got 10"):
        visual_graph(10)


@pytest.mark.parametrize("kind, batch", [("tiny", None), ("tiny", 2), ("unet328", None)])
def test_the_composed_model_equals_build_visual_and_the_model(tmp_path, kind, batch):
    path = write_model(tmp_path / "model.onnx", kind=kind, seed=3, batch=batch)
    model = onnx.load(str(path))
    composed = with_visual_input(model)
    crops_in, audio_in = composed.graph.input
    assert crops_in.name == CROPS_INPUT and audio_in.name == "audio"
    assert crops_in.type.tensor_type.elem_type == TensorProto.UINT8
    dims = crops_in.type.tensor_type.shape.dim
    assert [d.dim_value for d in dims[1:]] == [328, 328, 3]
    assert (dims[0].dim_value or dims[0].dim_param) == (batch or "batch")
    assert composed.graph.output == model.graph.output
    n = batch or 2
    crops = _crops(n, seed=7)
    audio = np.random.default_rng(8).standard_normal((n, *AUDIO_SHAPES["ave"])).astype(np.float32)
    want = make_session(path, "cpu", threads=2).run(None, {"input": _reference(crops), "audio": audio})[0]
    got = _session(composed, tmp_path / "composed.onnx").run(None, {CROPS_INPUT: crops, "audio": audio})[0]
    assert np.abs(got - want).max() <= 1e-5


def test_a_model_the_crops_cannot_go_in_front_of_is_refused():
    five = build_model("tiny")
    five.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 5
    with pytest.raises(AssetError, match=r"alice/model.onnx: no input of shape \[B,6,320,320\]"):
        with_visual_input(five, "alice/model.onnx")
    clash = build_model("tiny", audio_name=CROPS_INPUT)
    with pytest.raises(AssetError, match="already has a tensor named 'crops'"):
        with_visual_input(clash, "alice/model.onnx")
    old = build_model("tiny")
    old.opset_import[0].version = 10
    with pytest.raises(ValueError, match="alice/model.onnx: .*opset >= 11, got 10"):
        with_visual_input(old, "alice/model.onnx")


@pytest.mark.parametrize("kind", ["tiny", "unet328"])
def test_to_fp16_keeps_float32_io_and_stays_close(tmp_path, kind):
    # NOTE: the builder leaves its nodes unnamed, as torch.onnx.export does: the converter's own Cast
    # names collide on such a model unless to_fp16 names the nodes first
    model = build_model(kind, seed=5)
    converted, warning = to_fp16(model)
    assert warning is None
    onnx.checker.check_model(converted, full_check=True)
    assert _elem_types(converted.graph.input) == _elem_types(model.graph.input) == [TensorProto.FLOAT] * 2
    assert _elem_types(converted.graph.output) == [TensorProto.FLOAT]
    assert {t.data_type for t in converted.graph.initializer if t.name.endswith(".weight")} == {TensorProto.FLOAT16}
    rng = np.random.default_rng(6)
    feeds = {"input": rng.random((1, 6, 320, 320), dtype=np.float32),
             "audio": rng.standard_normal((1, *AUDIO_SHAPES["ave"])).astype(np.float32)}
    want = _session(model, tmp_path / "fp32.onnx").run(None, feeds)[0]
    got = _session(converted, tmp_path / "fp16.onnx").run(None, feeds)[0]
    assert got.dtype == np.float32 and np.abs(got - want).max() <= 1e-2


def test_crops_go_in_front_of_the_fp16_model_and_stay_float32(tmp_path):
    half, warning = to_fp16(build_model("unet328", seed=5))
    assert warning is None
    composed = with_visual_input(half)
    onnx.checker.check_model(composed, full_check=True)
    assert _elem_types(composed.graph.input) == [TensorProto.UINT8, TensorProto.FLOAT]
    assert _elem_types(composed.graph.output) == [TensorProto.FLOAT]
    crops = _crops(2, seed=9)
    audio = np.random.default_rng(10).standard_normal((2, *AUDIO_SHAPES["ave"])).astype(np.float32)
    want = _session(half, tmp_path / "fp16.onnx").run(None, {"input": _reference(crops), "audio": audio})[0]
    got = _session(composed, tmp_path / "composed.onnx").run(None, {CROPS_INPUT: crops, "audio": audio})[0]
    assert np.abs(got - want).max() <= 1e-5
    # the other order converts the crops graph's Cast to float32 into a float16 tensor: refused, by name
    same, warning = to_fp16(with_visual_input(build_model("tiny")))
    assert same.graph.input[0].name == CROPS_INPUT and "op Cast (node crops_to_visual/cast)" in warning


def test_a_model_that_cannot_convert_comes_back_unchanged_with_a_warning():
    # Celu has no float16 in its schema: the checker's type inference refuses the converted graph
    graph = helper.make_graph(
        [helper.make_node("Celu", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "celu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])])
    celu = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    celu.ir_version = 7
    same, warning = to_fp16(celu)
    assert same is celu
    assert "cannot be converted, running fp32" in warning and "Celu" in warning
    half, _ = to_fp16(build_model("tiny"))
    same, warning = to_fp16(half)
    assert same is half and "already converted to float16" in warning


def test_check_precision_refuses_fp16_on_the_cpu_provider():
    with pytest.raises(ValueError) as err:
        check_precision("fp16", "cpu")
    assert str(err.value) == CPU_FP16_ERROR
    assert "set inference.precision: fp32" in CPU_FP16_ERROR
    check_precision("fp32", "cpu")
    check_precision("fp16", "cuda:0")
    with pytest.raises(ValueError, match="inference.precision: expected one of fp32, fp16, got 'bf16'"):
        check_precision("bf16", "cuda:0")
