"""The visual input built where the model runs: a small ONNX graph that turns the avatar's uint8 crops
into `build_visual`'s float input (gpu_actor/visual.py), bit for bit. A GPU worker runs it as a session
of its own on the device, writing into the model's input buffer (gpu_actor/prepared.py), so a client's own
float visual input uses the same prepared model sessions, and it stays float32 whatever the precision.

    crops  [B, 328, 328, 3] uint8   BGR, the frame's 328x328 face crop (config/geometry.crop_328)
      -> Slice [4:324, 4:324] -> Transpose to CHW -> Cast float -> Div 255       R   [B, 3, 320, 320]
      -> R * mask (0 in rows 5:310, columns 5:315, else 1)                      M   [B, 3, 320, 320]
      -> Concat(R, M)                                                   visual  [B, 6, 320, 320] float32

A crop is 0.32 MB where the float input is 2.46 MB: on a GPU the crops are what crosses the bus. The
mask is built in the graph (a zero block padded with ones), not stored, and onnxruntime folds it into a
constant when the session is made. The transpose moves the uint8 crop, a quarter of the float's bytes
(on the CPU provider, 1.58 -> 1.38 ms a frame at 16 frames a call). Needs opset 11 or later (Pad and
Slice take tensors, not attributes).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from config.geometry import CROP_SIZE, INNER
from gpu_actor.visual import MASK_COLS, MASK_ROWS

CROPS_INPUT = "crops"        # visual_graph's input: uint8 [B, 328, 328, 3]
VISUAL_OUTPUT = "visual"     # visual_graph's output, float32 [B, 6, 320, 320]
MIN_OPSET = 11
_PREFIX = "crops_to_visual/"  # every tensor and node of the graph but its IO is named under this
_SIDE = INNER.stop - INNER.start


def _nodes(crops: str, visual: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The graph's nodes and constants, from tensor `crops` to tensor `visual`; every other name it makes
    starts with _PREFIX."""
    def name(n: str) -> str:
        return _PREFIX + n

    def const(n: str, values: list, dtype=TensorProto.INT64) -> onnx.TensorProto:
        return helper.make_tensor(name(n), dtype, [len(values)], values)

    # NOTE: build_visual divides each uint8 plane by float32 255 (np.divide, dtype float32): Cast then Div
    # is the same IEEE division, so the values are equal to the bit, where a multiply by 1/255 is not
    mask_shape = [1, 1, MASK_ROWS.stop - MASK_ROWS.start, MASK_COLS.stop - MASK_COLS.start]
    mask_pads = [0, 0, MASK_ROWS.start, MASK_COLS.start, 0, 0, _SIDE - MASK_ROWS.stop, _SIDE - MASK_COLS.stop]
    constants = [
        const("starts", [INNER.start, INNER.start]), const("ends", [INNER.stop, INNER.stop]),
        const("axes", [1, 2]),
        helper.make_tensor(name("255"), TensorProto.FLOAT, [], [255.0]),
        const("mask_shape", mask_shape), const("mask_pads", mask_pads),
        helper.make_tensor(name("one"), TensorProto.FLOAT, [], [1.0]),
    ]
    zero = helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0])
    nodes = [
        helper.make_node("Slice", [crops, name("starts"), name("ends"), name("axes")], [name("inner")],
                         name=name("slice")),
        helper.make_node("Transpose", [name("inner")], [name("planes")], perm=[0, 3, 1, 2], name=name("transpose")),
        helper.make_node("Cast", [name("planes")], [name("planes_f")], to=TensorProto.FLOAT, name=name("cast")),
        helper.make_node("Div", [name("planes_f"), name("255")], [name("reference")], name=name("div")),
        helper.make_node("ConstantOfShape", [name("mask_shape")], [name("hole")], value=zero, name=name("hole")),
        helper.make_node("Pad", [name("hole"), name("mask_pads"), name("one")], [name("mask")], mode="constant",
                         name=name("pad")),
        helper.make_node("Mul", [name("reference"), name("mask")], [name("masked")], name=name("mul")),
        helper.make_node("Concat", [name("reference"), name("masked")], [visual], axis=1, name=name("concat")),
    ]
    return nodes, constants


def _crops_info(batch) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(CROPS_INPUT, TensorProto.UINT8, [batch, CROP_SIZE, CROP_SIZE, 3])


def _check_opset(opset: int, source: str) -> None:
    if opset < MIN_OPSET:
        raise ValueError(f"{source}: the crops-to-visual graph needs ONNX opset >= {MIN_OPSET}, got {opset}")


def visual_graph(opset: int = MIN_OPSET) -> onnx.ModelProto:
    """A model of its own: input `crops` uint8 [batch, 328, 328, 3] (batch free) -> output `visual` float32
    [batch, 6, 320, 320], equal to build_visual's to the bit (tests/test_visual_onnx.py)."""
    _check_opset(opset, "visual_graph")
    nodes, constants = _nodes(CROPS_INPUT, VISUAL_OUTPUT)
    graph = helper.make_graph(
        nodes, "crops_to_visual", [_crops_info("batch")],
        [helper.make_tensor_value_info(VISUAL_OUTPUT, TensorProto.FLOAT, ["batch", 6, _SIDE, _SIDE])], constants)
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="lipsync-serve.preprocess")
    model.ir_version = helper.find_min_ir_version_for(opsets)  # NOTE: the newest IR may be newer than onnxruntime
    onnx.checker.check_model(model)
    return model
