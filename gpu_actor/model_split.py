"""A model file split into its architecture (the graph, weights made inputs) and its weights.

Every SyncTalk_2D avatar is the same unet_328 graph with other weights: a worker keeps one prepared
onnxruntime session per architecture and binds each model's weights per call
(gpu_actor/architectures.py), so a new avatar's load is reading and uploading its weights, never a new session or a new cuDNN plan.

Which tensors are weights: the floating-point initializers that only feed an op's data inputs (a Conv's
W and B, a MatMul's operands, an Add's addend...). Any other initializer (a Resize's scales, a Reshape's
shape) stays a constant of the graph, since ops need those at session creation, and its value is part of
the architecture.

The architecture's key is a hash of the graph's structure with every tensor renamed by its order of
appearance: op types, domains, attributes, the IO's names, types and shapes, each weight's type and shape,
each constant's value. Two files built alike with other weights (an imported avatar and
`demo-unet328`) have one key, whatever their tensor names; the first one's graph serves both.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from config.assets import AssetError

# (op type, input index) that take data a graph may feed at run time: weights may become inputs there.
_DATA_INPUTS = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (0, 1, 2), "MatMul": (0, 1), "Add": (0, 1), "Sub": (0, 1),
    "Mul": (0, 1), "Div": (0, 1), "BatchNormalization": (1, 2, 3, 4), "PRelu": (1,),
    "InstanceNormalization": (1, 2), "LayerNormalization": (1, 2),
}
_FLOATS = (1, 10, 11, 16)   # onnx TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16


@dataclass
class Architecture:
    """A graph whose weights are inputs: `weights` names them in canonical order, `shapes` and `dtypes`
    say what each model must bind there."""

    key: str
    graph: bytes                       # the serialized ModelProto, weights as inputs
    weights: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    def weights_of(self, source: str, split: "Split") -> list[np.ndarray]:
        """A model's weights (`split` of its file) in this architecture's order and types (an fp16
        architecture's are cast): the error, which starts with `source` (the model's file, as every load
        error does: a caller that reports it adds the model's id), names a tensor that is missing or of
        another shape."""
        by_name = dict(zip(split.architecture.weights, split.weights))
        arrays = []
        for name, shape, dtype in zip(self.weights, self.shapes, self.dtypes):
            array = by_name.get(name)
            if array is None:
                raise AssetError(f"{source}: it has no weight {name}, which its architecture needs ({list(shape)})")
            if array.shape != shape:
                raise AssetError(f"{source}: weight {name} is {list(array.shape)}, its architecture needs "
                                 f"{list(shape)}")
            arrays.append(array.astype(dtype, copy=False))
        return arrays


@dataclass
class Split:
    architecture: Architecture
    weights: list[np.ndarray]          # in the architecture's order


def _canonical(graph) -> dict[str, str]:
    """Each tensor name -> its number by order of appearance (inputs, then nodes' inputs and outputs)."""
    names: dict[str, str] = {}
    for value in graph.input:
        names.setdefault(value.name, value.name)   # IO keeps its name: it is part of the architecture
    for node in graph.node:
        for name in (*node.input, *node.output):
            if name and name not in names:
                names[name] = f"t{len(names)}"
    for value in graph.output:
        names[value.name] = value.name
    return names


def _check_references(graph, path: Path) -> None:
    known = {v.name for v in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in graph.node:
        for name in node.input:
            if name not in known:
                raise AssetError(f"{path}: tensor {name!r}, an input of {node.op_type} node {node.name!r}, is neither a "
                                 "graph input, an initializer, nor the output of an earlier node")
        known.update(node.output)
    for value in graph.output:
        if value.name not in known:
            raise AssetError(f"{path}: graph output {value.name!r} is produced by no node")


def check_convolutions(architecture: Architecture, path: Path) -> None:
    """A Conv's weight must take the channels that reach it: the error names the tensor and both shapes
    (onnxruntime would say only "Input channels C is not equal to kernel channels * group", at run).
    Once per architecture (its key holds every weight's shape); on the graph with weights as inputs,
    so shape inference reads no tensor data (0.27 s less on unet_328)."""
    import onnx
    model = onnx.load_from_string(architecture.graph)
    weights = {name: list(shape) for name, shape in zip(architecture.weights, architecture.shapes)}
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:   # onnxruntime's own checks still apply at session creation and warm-up
        return
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in (*inferred.input, *inferred.value_info)}
    for node in model.graph.node:
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in weights:
            continue
        x, w = shapes.get(node.input[0]), weights[node.input[1]]
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if x and len(x) == len(w) and x[1] and len(w) > 1 and w[1] * group != x[1]:
            raise AssetError(f"{path}: weight {node.input[1]} is {w}, but the Conv it feeds gets {x[1]} channels "
                             f"(group {group}): it needs [{w[0]}, {x[1] // group}, {', '.join(map(str, w[2:]))}]")
        if len(node.input) > 2 and node.input[2] in weights and weights[node.input[2]] != [w[0]]:
            raise AssetError(f"{path}: bias {node.input[2]} is {weights[node.input[2]]}, but its Conv has {w[0]} "
                             f"output channels: it needs [{w[0]}]")


def split_model(path: Path) -> Split:
    """Read an ONNX file into its architecture and its weights; AssetError says what is wrong with it."""
    import onnx
    if not path.exists():
        raise AssetError(f"{path}: model file is missing")
    try:
        model = onnx.load(str(path))
    except Exception as err:   # protobuf's and onnx's own exception types for bad files
        raise AssetError(f"{path}: not an ONNX model: {str(err).splitlines()[0][:300] if str(err) else type(err).__name__}") from None
    return split_proto(model, path)


def split_proto(model, path: Path) -> Split:
    """`split_model` of a ModelProto (changed in place); `path` names it in errors."""
    import onnx
    from onnx import numpy_helper
    graph = model.graph
    # NOTE: before IR version 4 every initializer is also listed as a graph input (a default a caller may
    # override): such entries are weights or constants here, not the model's inputs.
    initialized = {t.name for t in graph.initializer}
    kept = [v for v in graph.input if v.name not in initialized]
    del graph.input[:]
    graph.input.extend(kept)
    _check_references(graph, path)
    consumers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type if node.domain in ("", "ai.onnx") else "?", index))
    weights, constants = [], []
    for init in graph.initializer:
        uses = consumers.get(init.name, [])
        data = all(index in _DATA_INPUTS.get(op, ()) for op, index in uses)
        if init.data_type in _FLOATS and uses and data:
            weights.append(init)
        else:
            constants.append(init)
    names = _canonical(graph)
    # NOTE: by position in `names`, not by parsing "tN": a weight that is also a graph output keeps its own name
    order = {name: position for position, name in enumerate(names)}
    weights.sort(key=lambda t: order[t.name])
    arrays = [numpy_helper.to_array(t) for t in weights]
    key = _key(model, names, weights, arrays, constants)
    del graph.initializer[:]
    graph.initializer.extend(constants)
    for tensor, array in zip(weights, arrays):
        graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(array.shape)))
    architecture = Architecture(key, model.SerializeToString(), tuple(t.name for t in weights),
                                tuple(a.shape for a in arrays), tuple(a.dtype for a in arrays))
    # NOTE: not np.ascontiguousarray, which makes a 0-d weight ([], `x * 0.5` as torch exports it) a [1]
    return Split(architecture, [np.require(a, requirements="C") for a in arrays])


def _key(model, names: dict[str, str], weights, arrays, constants) -> str:
    h = hashlib.sha256()

    def put(*parts) -> None:
        for part in parts:
            h.update(part if isinstance(part, bytes) else str(part).encode())
            h.update(b"\0")

    put("opsets", *sorted((o.domain, o.version) for o in model.opset_import))
    for value in (*model.graph.input, *model.graph.output):
        put("io", value.name, value.type.SerializeToString())
    for node in model.graph.node:
        put("node", node.domain, node.op_type, *(names.get(n, "") for n in node.input), "->",
            *(names[n] for n in node.output))
        for attr in sorted(node.attribute, key=lambda a: a.name):
            put(attr.SerializeToString())
    for tensor, array in zip(weights, arrays):
        put("weight", names[tensor.name], array.dtype.str, array.shape)
    from onnx import numpy_helper
    for tensor in sorted(constants, key=lambda t: names.get(t.name, t.name)):
        value = numpy_helper.to_array(tensor)
        put("constant", names.get(tensor.name, ""), value.dtype.str, value.shape,
            hashlib.sha256(np.ascontiguousarray(value).tobytes()).digest())
    return h.hexdigest()[:16]
