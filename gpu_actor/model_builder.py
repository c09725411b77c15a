"""Write ONNX models with unet_328's inputs, outputs, architecture and cost: from a trained SyncTalk_2D
checkpoint's weights, or random ones (one code path for both: the graph asks a weight source for each
convolution by its name in SyncTalk_2D's state_dict).

SyncTalk_2D's unet_328 (batch-norm folded into the convolutions, as an export for inference has it):

    visual [B,6,320,320] -> inc IR(6->32) -> down1..5 (32,64,128,256,512; each DoubleConvDW stride 2)
                             320            160,80,40,20,10
    audio  [B,*A]        -> audio branch -> 512 x 10 x 10
    concat (1024) -> fuse DoubleConvDW 1024->512, 512->256
    up1..5: bilinear x2 (align_corners) + skip concat + DoubleConvDW -> 128, 64, 32, 32, 16
    1x1 conv 16->3 (with bias, no batch norm) -> sigmoid -> output [B,3,320,320]

InvertedResidual (IR) = 1x1 conv (expand 2) -> BN -> ReLU -> 3x3 depthwise (stride s) -> BN -> ReLU ->
1x1 conv -> BN, plus the input when it is the residual one (no ReLU after the sum). About 12.2 M
parameters and 4.9 GMAC per frame (`describe`).

`tiny` has the same inputs and output but costs almost nothing: sigmoid(1x1 conv(visual) + mean(audio)).

CLI: python -m gpu_actor.model_builder OUT.onnx [--kind unet328|tiny|audio_encoder] [--audio ave|hubert|wenet]
     [--seed N] [--batch N]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

AUDIO_SHAPES = {"ave": (32, 16, 16), "hubert": (32, 32, 32), "wenet": (256, 16, 32)}
OPSET = 11
BN_EPS = 1e-5   # torch.nn.BatchNorm2d's default, which SyncTalk_2D's modules keep


class WeightsError(ValueError):
    """A state_dict does not fit the network: the message names the first key that is missing, unexpected
    or of another shape."""


class RandomWeights:
    """He-initialised convolutions whose bias stands for a folded batch-norm shift: the network's cost,
    not a trained one. `gain` scales a convolution that a trained network would keep small."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def conv(self, conv: str, shape: tuple[int, ...], bias: bool, bn: Optional[str], gain: float):
        cout, cin_per_group, k, _ = shape
        w = self.rng.normal(0.0, gain * np.sqrt(2.0 / (cin_per_group * k * k)), shape)
        return w, self.rng.normal(0.0, 0.01, (cout,))

    def unused(self) -> list[str]:
        return []


class StateDictWeights:
    """A SyncTalk_2D state_dict (name -> numpy array): each convolution's weight and bias, with the batch
    norm that follows it folded in: w' = w * g / sqrt(var + eps), b' = (b - mean) * g / sqrt(var + eps) + beta."""

    def __init__(self, state_dict: Mapping[str, np.ndarray], eps: float = BN_EPS):
        self.state = state_dict
        self.eps = eps
        self.used: set[str] = set()

    def _take(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in self.state:
            raise WeightsError(f"missing key {key} (expected shape {list(shape)})")
        value = np.asarray(self.state[key])
        if value.shape != shape:
            raise WeightsError(f"key {key} has shape {list(value.shape)}, expected {list(shape)}")
        if not np.issubdtype(value.dtype, np.floating) or not np.isfinite(value).all():
            raise WeightsError(f"key {key} must hold finite floating-point numbers, got {value.dtype}")
        self.used.add(key)
        return value.astype(np.float64)

    def conv(self, conv: str, shape: tuple[int, ...], bias: bool, bn: Optional[str], gain: float):
        cout = shape[0]
        w = self._take(f"{conv}.weight", shape)
        b = self._take(f"{conv}.bias", (cout,)) if bias else np.zeros(cout)
        if bn is None:
            return w, b
        gamma, beta, mean, var = (self._take(f"{bn}.{p}", (cout,))
                                  for p in ("weight", "bias", "running_mean", "running_var"))
        if (var < 0).any():
            raise WeightsError(f"key {bn}.running_var has negative entries: not a trained batch norm")
        self.used.add(f"{bn}.num_batches_tracked")   # a training counter: nothing to fold
        scale = gamma / np.sqrt(var + self.eps)
        return w * scale[:, None, None, None], (b - mean) * scale + beta

    def unused(self) -> list[str]:
        return [k for k in self.state if k not in self.used]


class _Graph:
    """Accumulates nodes and initializers; every op returns its output name."""

    def __init__(self, weights):
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.params = 0
        self._n = 0

    def _name(self, kind: str) -> str:
        self._n += 1
        return f"{kind}_{self._n}"

    def _init(self, array: np.ndarray, name: str) -> str:
        self.inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        self.params += array.size
        return name

    def conv(self, x: str, name: str, cin: int, cout: int, k: int, stride=1, pad=0, groups=1, gain=1.0,
             bias=False, bn: Optional[str] = None) -> str:
        """SyncTalk_2D's nn.Conv2d `name` (with its own bias when `bias`), and the BatchNorm2d `bn` after it."""
        w, b = self.weights.conv(name, (cout, cin // groups, k, k), bias, bn, gain)
        strides = list(stride) if isinstance(stride, tuple) else [stride, stride]
        out = self._name("conv")
        self.nodes.append(helper.make_node(
            "Conv", [x, self._init(w, f"{name}.weight"), self._init(b, f"{name}.bias")], [out],
            kernel_shape=[k, k], strides=strides, pads=[pad] * 4, group=groups))
        return out

    def op(self, kind: str, *inputs: str, **attrs) -> str:
        out = self._name(kind.lower())
        self.nodes.append(helper.make_node(kind, list(inputs), [out], **attrs))
        return out

    def relu(self, x: str) -> str:
        return self.op("Relu", x)

    def inverted_residual(self, x: str, name: str, cin: int, cout: int, stride=1, residual=False) -> str:
        hidden = cin * 2
        c = f"{name}.conv"
        y = self.relu(self.conv(x, f"{c}.0", cin, hidden, 1, bn=f"{c}.1"))
        y = self.relu(self.conv(y, f"{c}.3", hidden, hidden, 3, stride, 1, groups=hidden, bn=f"{c}.4"))
        # Random residual branches start small so that deep stacks keep activations in range.
        y = self.conv(y, f"{c}.6", hidden, cout, 1, gain=0.3 if residual else 1.0, bn=f"{c}.7")
        return self.op("Add", x, y) if residual else y

    def double_conv(self, x: str, name: str, cin: int, cout: int, stride: int) -> str:
        """DoubleConvDW `name`: its `double_conv` Sequential of two inverted residuals."""
        y = self.inverted_residual(x, f"{name}.double_conv.0", cin, cout, stride)
        return self.inverted_residual(y, f"{name}.double_conv.1", cout, cout, 1, residual=True)

    def up(self, x: str, skip: str, name: str, cin: int, cout: int) -> str:
        empty = self._init(np.zeros((0,), np.float32), self._name("roi"))
        scales = self._init(np.array([1, 1, 2, 2], np.float32), self._name("scales"))
        self.params -= 4  # resize scales are not parameters
        y = self.op("Resize", x, empty, scales, mode="linear",
                    coordinate_transformation_mode="align_corners")
        return self.double_conv(self.op("Concat", y, skip, axis=1), f"{name}.conv", cin, cout, 1)


def _audio_branch(g: _Graph, a: str, audio: str) -> str:
    """SyncTalk_2D's AudioConvAve / AudioConvHubert / AudioConvWenet (`audio_model`): features -> 512 x 10 x 10."""
    m = "audio_model"
    if audio == "wenet":
        y = g.inverted_residual(a, f"{m}.conv1", 256, 256, residual=True)
        y = g.inverted_residual(y, f"{m}.conv2", 256, 256, residual=True)
        stride3 = (1, 2)
    else:
        y = g.inverted_residual(a, f"{m}.conv1", 32, 64)
        y = g.inverted_residual(y, f"{m}.conv2", 64, 128)
        stride3 = 2 if audio == "hubert" else 1
    y = g.relu(g.conv(y, f"{m}.conv3", 128 if audio != "wenet" else 256, 256, 3, stride3, 1, bias=True, bn=f"{m}.bn3"))
    y = g.inverted_residual(y, f"{m}.conv4", 256, 256, residual=True)
    y = g.relu(g.conv(y, f"{m}.conv5", 256, 512, 3, 2, 3, bias=True, bn=f"{m}.bn5"))
    y = g.inverted_residual(y, f"{m}.conv6", 512, 512, residual=True)
    return g.inverted_residual(y, f"{m}.conv7", 512, 512, residual=True)


def _unet328(g: _Graph, visual: str, audio_in: str, audio: str) -> str:
    ch = [32, 64, 128, 256, 512]
    x1 = g.inverted_residual(visual, "inc.inconv.0", 6, ch[0])
    x2 = g.double_conv(x1, "down1.maxpool_conv.0", ch[0], ch[0], 2)
    x3 = g.double_conv(x2, "down2.maxpool_conv.0", ch[0], ch[1], 2)
    x4 = g.double_conv(x3, "down3.maxpool_conv.0", ch[1], ch[2], 2)
    x5 = g.double_conv(x4, "down4.maxpool_conv.0", ch[2], ch[3], 2)
    x6 = g.double_conv(x5, "down5.maxpool_conv.0", ch[3], ch[4], 2)
    a = _audio_branch(g, audio_in, audio)
    y = g.op("Concat", x6, a, axis=1)
    y = g.double_conv(y, "fuse_conv.0", ch[4] * 2, ch[4], 1)
    y = g.double_conv(y, "fuse_conv.1", ch[4], ch[3], 1)
    y = g.up(y, x5, "up1", ch[4], ch[3] // 2)
    y = g.up(y, x4, "up2", ch[3], ch[2] // 2)
    y = g.up(y, x3, "up3", ch[2], ch[1] // 2)
    y = g.up(y, x2, "up4", ch[1], ch[0])
    y = g.up(y, x1, "up5", ch[1], ch[0] // 2)
    # gain: random weights keep the sigmoid out of saturation
    return g.conv(y, "outc.conv", ch[0] // 2, 3, 1, gain=0.05, bias=True)


def _tiny(g: _Graph, visual: str, audio_in: str) -> str:
    v = g.conv(visual, "tiny", 6, 3, 1, gain=0.5)
    a = g.op("ReduceMean", audio_in, axes=[1, 2, 3], keepdims=1)
    return g.op("Add", v, a)


def _finish(g: _Graph, weights, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
    unexpected = weights.unused()
    if unexpected:
        key = unexpected[0]
        raise WeightsError(f"unexpected key {key} (shape {list(np.shape(weights.state[key]))}): "
                           f"not part of {name}" + (f", nor are {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="lipsync-serve.model_builder")
    model.ir_version = 7  # what opset 11 pairs with; loadable by every onnxruntime since 1.6
    model.metadata_props.append(onnx.StringStringEntryProto(key="parameters", value=str(g.params)))
    onnx.checker.check_model(model)
    return model


def build_model(kind: str = "unet328", audio: str = "ave", seed: int = 0, batch: Optional[int] = None,
                visual_name: str = "input", audio_name: str = "audio",
                state_dict: Optional[Mapping[str, np.ndarray]] = None) -> onnx.ModelProto:
    """unet_328 (or `tiny`) with random weights, or with a SyncTalk_2D unet_328 `state_dict`'s
    (its key names, batch norm folded; WeightsError names the first key that does not fit)."""
    if audio not in AUDIO_SHAPES:
        raise ValueError(f"audio must be one of {sorted(AUDIO_SHAPES)}, got {audio!r}")
    if kind not in ("unet328", "tiny"):
        raise ValueError(f"kind must be 'unet328' or 'tiny', got {kind!r}")
    weights = RandomWeights(seed) if state_dict is None else StateDictWeights(state_dict)
    g = _Graph(weights)
    b = batch if batch is not None else "batch"
    logits = _unet328(g, visual_name, audio_name, audio) if kind == "unet328" else _tiny(g, visual_name, audio_name)
    g.nodes.append(helper.make_node("Sigmoid", [logits], ["output"]))
    return _finish(g, weights, f"{kind}_{audio}",
                   [helper.make_tensor_value_info(visual_name, TensorProto.FLOAT, [b, 6, 320, 320]),
                    helper.make_tensor_value_info(audio_name, TensorProto.FLOAT, [b, *AUDIO_SHAPES[audio]])],
                   [helper.make_tensor_value_info("output", TensorProto.FLOAT, [b, 3, 320, 320])])


# SyncTalk_2D's AudioEncoder (utils.py): (cin, cout, kernel, stride, pad, residual) per Conv2d block
# `audio_encoder.<i>`, each conv (with bias) + batch norm (folded here) [+ input] -> ReLU.
# A mel window [B, 1, 80, 16] -> [B, 512].
_AUDIO_ENCODER = [
    (1, 32, 3, 1, 1, False), (32, 32, 3, 1, 1, True), (32, 32, 3, 1, 1, True),
    (32, 64, 3, (3, 1), 1, False), (64, 64, 3, 1, 1, True), (64, 64, 3, 1, 1, True),
    (64, 128, 3, 3, 1, False), (128, 128, 3, 1, 1, True), (128, 128, 3, 1, 1, True),
    (128, 256, 3, (3, 2), 1, False), (256, 256, 3, 1, 1, True),
    (256, 512, 3, 1, 0, False), (512, 512, 1, 1, 0, False),
]


def build_audio_encoder(seed: int = 0, batch: Optional[int] = None,
                        state_dict: Optional[Mapping[str, np.ndarray]] = None) -> onnx.ModelProto:
    """The ave audio encoder, mel [B, 1, 80, 16] -> features [B, 512], with random weights or with an
    AudioEncoder `state_dict`'s (keys `audio_encoder.<i>.conv_block.<0|1>.*`, as the module names them)."""
    weights = RandomWeights(seed) if state_dict is None else StateDictWeights(state_dict)
    g = _Graph(weights)
    x = "mel"
    for i, (cin, cout, k, stride, pad, residual) in enumerate(_AUDIO_ENCODER):
        block = f"audio_encoder.{i}.conv_block"
        y = g.conv(x, f"{block}.0", cin, cout, k, stride, pad, gain=0.3 if residual else 1.0, bias=True,
                   bn=f"{block}.1")
        x = g.relu(g.op("Add", y, x) if residual else y)
    g.nodes.append(helper.make_node("Flatten", [x], ["features"], axis=1))
    b = batch if batch is not None else "batch"
    return _finish(g, weights, "audio_encoder_ave",
                   [helper.make_tensor_value_info("mel", TensorProto.FLOAT, [b, 1, 80, 16])],
                   [helper.make_tensor_value_info("features", TensorProto.FLOAT, [b, 512])])


def write_audio_encoder(path: str | Path, **kwargs) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".onnx.tmp")
    onnx.save(build_audio_encoder(**kwargs), str(tmp))
    tmp.replace(path)
    return path


def write_model(path: str | Path, **kwargs) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".onnx.tmp")
    onnx.save(build_model(**kwargs), str(tmp))
    tmp.replace(path)  # never leave a half-written model where a server may load it
    return path


def describe(model: onnx.ModelProto) -> dict:
    """Parameters and multiply-accumulates per frame (convolutions only, as thop counts them)."""
    from onnx import shape_inference
    inferred = shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value or 1 for d in v.type.tensor_type.shape.dim]
              for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    weights = {t.name: tuple(t.dims) for t in model.graph.initializer}
    macs = 0
    for node in model.graph.node:
        if node.op_type == "Conv":
            cout, cin_per_group, kh, kw = weights[node.input[1]]
            out = shapes[node.output[0]]
            macs += cout * cin_per_group * kh * kw * out[2] * out[3]
    params = sum(int(np.prod(d)) for n, d in weights.items() if not n.startswith(("roi", "scales")))
    return {"parameters": params, "gmac_per_frame": macs / 1e9}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_actor.model_builder", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="path of the .onnx file to write")
    parser.add_argument("--kind", choices=["unet328", "tiny", "audio_encoder"], default="unet328",
                        help="audio_encoder: SyncTalk_2D's ave AudioEncoder, mel [B,1,80,16] -> [B,512]")
    parser.add_argument("--audio", choices=sorted(AUDIO_SHAPES), default="ave")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=None, help="fixed batch size (default: dynamic)")
    args = parser.parse_args(argv)
    if args.kind == "audio_encoder":
        path = write_audio_encoder(args.out, seed=args.seed)
        info = describe(onnx.load(str(path)))
        print(f"wrote {path}: audio encoder, {info['parameters'] / 1e6:.2f} M parameters, "
              f"{info['gmac_per_frame'] * 1000:.1f} MMAC per window")
        return 0
    path = write_model(args.out, kind=args.kind, audio=args.audio, seed=args.seed, batch=args.batch)
    info = describe(onnx.load(str(path)))
    print(f"wrote {path}: {args.kind}/{args.audio}, {info['parameters'] / 1e6:.2f} M parameters, "
          f"{info['gmac_per_frame']:.2f} GMAC per frame")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
