"""The demo avatar's talking model and audio encoder: small ONNX graphs, not networks, with the real
I/O contract, so that a newcomer sees lip-sync without trained weights.

    model:   visual [B,6,320,320] + ave audio [B,32,16,16] -> [B,3,320,320]
             the unmasked reference crop, with a mouth drawn whose opening follows the loudness the
             window's own frame carries (its row 8 of 16); closed (nothing drawn) in silence
    encoder: mel [B,1,80,16] -> [B,512], every value the window's loudness in [0, 1]
             (mean normalised log-mel: -4 in silence, about -1 .. 1 in speech)

The mouth is one of OPENINGS precomputed ellipses, blended by a clipped loudness measure.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 11
OPENINGS = 6
MOUTH_CENTRE = (160, 176)       # in the 320x320 crop the demo scene's face box gives (supervisor/demo.py)
MOUTH_HALF_WIDTH = 42
MOUTH_MAX_HALF_HEIGHT = 30
MOUTH_BGR = (40, 25, 95)        # the inside of a mouth
SILENCE, FULL = 0.15, 0.55      # loudness below SILENCE: closed; at FULL: open wide


def mouth_masks() -> np.ndarray:
    """[1, OPENINGS, 320, 320] float32: opening 0 is empty (closed: the face's own mouth shows)."""
    masks = np.zeros((1, OPENINGS, 320, 320), np.float32)
    for k in range(1, OPENINGS):
        half_height = max(2, round(MOUTH_MAX_HALF_HEIGHT * k / (OPENINGS - 1)))
        img = np.zeros((320, 320), np.uint8)
        cv2.ellipse(img, MOUTH_CENTRE, (MOUTH_HALF_WIDTH, half_height), 0, 0, 360, 255, -1)
        masks[0, k] = cv2.GaussianBlur(img, (0, 0), 1.5) / 255.0
    return masks


def _const(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, np.float32), name)


def build_demo_model() -> onnx.ModelProto:
    inits = [
        _const("masks", mouth_masks()),
        _const("levels", np.arange(OPENINGS, dtype=np.float32).reshape(1, OPENINGS, 1, 1)),
        _const("colour", (np.array(MOUTH_BGR, np.float32) / 255).reshape(1, 3, 1, 1)),
        _const("silence", [SILENCE]), _const("span", [(FULL - SILENCE) / (OPENINGS - 1)]),
        _const("zero", 0.0), _const("top", float(OPENINGS - 1)), _const("one", [1.0]),
        numpy_helper.from_array(np.array([0], np.int64), "s0"), numpy_helper.from_array(np.array([3], np.int64), "s3"),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        numpy_helper.from_array(np.array([16], np.int64), "r16"), numpy_helper.from_array(np.array([18], np.int64), "r18"),
    ]
    nodes = [
        helper.make_node("Slice", ["input", "s0", "s3", "ax1"], ["crop"]),                  # unmasked crop, BGR/255
        helper.make_node("Slice", ["audio", "r16", "r18", "ax1"], ["own"]),                 # window row 8: this frame
        helper.make_node("ReduceMean", ["own"], ["loud"], axes=[1, 2, 3], keepdims=1),      # [B,1,1,1]
        helper.make_node("Sub", ["loud", "silence"], ["above"]),
        helper.make_node("Div", ["above", "span"], ["scaled"]),
        helper.make_node("Clip", ["scaled", "zero", "top"], ["opening"]),                 # 0 .. OPENINGS-1
        helper.make_node("Sub", ["opening", "levels"], ["distance"]),                      # [B,K,1,1]
        helper.make_node("Abs", ["distance"], ["far"]),
        helper.make_node("Sub", ["one", "far"], ["near"]),
        helper.make_node("Relu", ["near"], ["weights"]),                                   # blend of two shapes
        helper.make_node("Mul", ["weights", "masks"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["alpha"], axes=[1], keepdims=1),       # [B,1,320,320]
        helper.make_node("Sub", ["colour", "crop"], ["towards"]),
        helper.make_node("Mul", ["alpha", "towards"], ["change"]),
        helper.make_node("Add", ["crop", "change"], ["output"]),
    ]
    graph = helper.make_graph(nodes, "demo_talking_mouth",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 6, 320, 320]),
                               helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", 32, 16, 16])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3, 320, 320])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="lipsync-serve.demo_model")
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def build_demo_encoder() -> onnx.ModelProto:
    inits = [_const("four", [4.0]), _const("five", [5.0]), _const("zero", 0.0), _const("one", 1.0),
             _const("ones", np.ones((1, 512), np.float32))]
    nodes = [
        helper.make_node("ReduceMean", ["mel"], ["level"], axes=[2, 3], keepdims=0),     # [B,1]
        helper.make_node("Add", ["level", "four"], ["lifted"]),
        helper.make_node("Div", ["lifted", "five"], ["scaled"]),
        helper.make_node("Clip", ["scaled", "zero", "one"], ["loudness"]),
        helper.make_node("MatMul", ["loudness", "ones"], ["features"]),                  # [B,512]
    ]
    graph = helper.make_graph(nodes, "demo_loudness_encoder",
                              [helper.make_tensor_value_info("mel", TensorProto.FLOAT, ["batch", 1, 80, 16])],
                              [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 512])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="lipsync-serve.demo_model")
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def write_demo_models(directory: Path) -> None:
    """model.onnx and audio_encoder.onnx of the talking demo avatar, into `directory`."""
    for name, model in (("model.onnx", build_demo_model()), ("audio_encoder.onnx", build_demo_encoder())):
        tmp = directory / f"{name}.tmp"
        onnx.save(model, str(tmp))
        tmp.replace(directory / name)
