"""The visual input built by the model's own graph (gpu_actor/visual_onnx.py) and inference.precision
(gpu_actor/precision.py), on the CPU provider with the worker's session options."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from gpu_actor.device import CpuDevice
from gpu_actor.model_builder import AUDIO_SHAPES, build_model
from gpu_actor.own_session import own_session
from gpu_actor.precision import to_fp16
from gpu_actor.visual import build_visual
from gpu_actor.visual_onnx import CROPS_INPUT, VISUAL_OUTPUT, visual_graph


def _session(model: onnx.ModelProto, path):
    onnx.save(model, str(path))
    return own_session(path, CpuDevice(), threads=2)


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
    # float16's rounding shows (the weights really changed type), within ~4x of what was measured
    # (tiny 3.8e-5, unet328 5.3e-4 at most, on the CPU provider)
    error = float(np.abs(got - want).max())
    assert got.dtype == np.float32 and 0 < error <= {"tiny": 2e-4, "unet328": 2e-3}[kind], error


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


def test_the_cpu_provider_runs_fp32_only_the_gpu_path_fp16_too():
    from gpu_actor.cuda import CudaDevice
    from gpu_actor.device import StandInDevice
    assert CpuDevice.precisions == ("fp32",)
    assert StandInDevice.precisions == CudaDevice.precisions == ("fp32", "fp16")
