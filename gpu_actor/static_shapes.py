"""Every tensor's static shape in an ONNX graph whose inputs' first axis (the batch) is fixed to a size.

onnx's shape inference, and the sizes it does not follow computed where they are constants at that batch:
torch.onnx.export writes `x.view(x.size(0), -1)` and an interpolation's output size as Shape -> Gather ->
Concat -> Reshape (or Resize), whose output shape onnx leaves unknown even with data propagation.
gpu_actor/grouped.py probes a graph at two batch sizes with it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


class ShapeError(ValueError):
    """onnx's shape inference refuses the graph at that batch; the message is its first line."""


def infer_at_batch(model, inputs, probe: int, strict: bool = True) -> tuple[dict, dict]:
    """Every tensor's shape (a tuple, None for an unknown dim) and element type with the first axis of
    the graph inputs named in `inputs` fixed to `probe`. ShapeError where onnx refuses the graph; not
    `strict`: a node whose inference fails leaves its outputs (and what follows) out instead.

    NOTE: onnx's inference does not follow sizes computed from shapes (Shape -> Gather -> Concat ->
    Reshape, as torch.onnx.export writes `x.view(x.size(0), -1)` or an interpolation's sizes): at a fixed
    batch they are constants, so they are computed here (_fold_sizes) and inference runs again with them
    as initializers, of this copy only."""
    import onnx
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    for value in m.graph.input:
        if value.name in inputs:
            value.type.tensor_type.shape.dim[0].Clear()
            value.type.tensor_type.shape.dim[0].dim_value = probe
    for value in m.graph.output:
        if value.type.tensor_type.shape.dim:
            value.type.tensor_type.shape.dim[0].Clear()   # NOTE: a fixed-batch model's declared 1 is not the probe's
    for _ in range(16):
        try:
            inferred = onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=strict, data_prop=True).graph
        except Exception as err:   # onnx raises its own inference errors
            raise ShapeError(f"shape inference fails at batch {probe}: {str(err).splitlines()[0][:300]}") from None
        shapes = {t.name: tuple(t.dims) for t in inferred.initializer}
        types = {t.name: t.data_type for t in inferred.initializer}
        for v in (*inferred.input, *inferred.value_info, *inferred.output):
            t = v.type.tensor_type
            types[v.name] = t.elem_type
            if t.HasField("shape"):
                shapes[v.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
        if not _fold_sizes(m.graph, shapes):
            break
    return shapes, types


def _axes(node, axes) -> Optional[tuple[int, ...]]:
    """Squeeze's or Unsqueeze's axes: its input (opset 13) or its attribute."""
    axes = axes if axes is not None else attribute(node, "axes")
    return None if axes is None else tuple(int(a) for a in np.ravel(axes))


def _slice(node, x, starts, ends, axes=None, steps=None):
    axes = range(len(starts)) if axes is None else [int(a) % x.ndim for a in axes]
    index = [slice(None)] * x.ndim
    for k, axis in enumerate(axes):
        index[axis] = slice(int(starts[k]), int(ends[k]), 1 if steps is None else int(steps[k]))
    return x[tuple(index)]


def _divide(a, b):
    return (a / b).astype(a.dtype) if a.dtype.kind == "f" else np.trunc(a / b).astype(a.dtype)


# What sizes are computed with (torch.onnx.export's patterns), in numpy: node, inputs -> value.
_SIZE_OPS = {
    "Identity": lambda n, x: x, "Add": lambda n, a, b: a + b, "Sub": lambda n, a, b: a - b,
    "Mul": lambda n, a, b: a * b, "Div": lambda n, a, b: _divide(a, b), "Floor": lambda n, x: np.floor(x),
    "Ceil": lambda n, x: np.ceil(x), "Equal": lambda n, a, b: a == b, "Where": lambda n, c, a, b: np.where(c, a, b),
    "Max": lambda n, *xs: np.maximum.reduce(xs), "Min": lambda n, *xs: np.minimum.reduce(xs),
    "Cast": lambda n, x: x.astype(np_dtype(attribute(n, "to"))),
    "Gather": lambda n, x, i: np.take(x, i, axis=attribute(n, "axis", 0)),
    "Concat": lambda n, *xs: np.concatenate(xs, axis=attribute(n, "axis")),
    "Unsqueeze": lambda n, x, axes=None: np.expand_dims(x, _axes(n, axes)),
    "Squeeze": lambda n, x, axes=None: np.squeeze(x, _axes(n, axes)),
    "Slice": _slice,
}
_SIZE_MAX = 64    # elements: a size vector, never a tensor of data


def _fold_sizes(graph, shapes: dict) -> bool:
    """Replace, in `graph`, each node that computes a small tensor from shapes now known (Shape, and what
    Gathers, Concats, casts or sums those) by an initializer of its value; True where one was."""
    from onnx import numpy_helper
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    outputs = {v.name for v in graph.output}
    kept, folded = [], False
    for node in graph.node:
        value = None
        if node.op_type == "Constant":
            values[node.output[0]] = constant_value(node)
        elif node.op_type in ("Shape", "Size") and None not in shapes.get(node.input[0], (None,)):
            shape = shapes[node.input[0]]
            value = (np.array(shape[slice(attribute(node, "start", 0), attribute(node, "end"))], np.int64)
                     if node.op_type == "Shape" else np.array(int(np.prod(shape, dtype=np.int64)), np.int64))
        elif node.op_type in _SIZE_OPS and all(not x or x in values for x in node.input):
            try:
                value = np.asarray(_SIZE_OPS[node.op_type](node, *(values[x] if x else None for x in node.input)))
            except Exception:   # numpy's errors: the node is left to onnx's inference
                value = None
        if value is None or value.size > _SIZE_MAX or node.domain not in ("", "ai.onnx") or \
                len(node.output) != 1 or node.output[0] in outputs:
            kept.append(node)
            continue
        values[node.output[0]] = value
        graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
        folded = True
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
    return folded


def constant_value(node) -> Optional[np.ndarray]:
    """A Constant node's value (its `value` tensor, or a value_float(s) / value_int(s))."""
    from onnx import numpy_helper
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name in ("value_float", "value_int", "value_floats", "value_ints"):
            return np.array(attribute(node, a.name), np.float32 if "float" in a.name else np.int64)
    return None


def attribute(node, name: str, default=None):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def np_dtype(elem_type: int):
    from onnx import helper
    return helper.tensor_dtype_to_np_dtype(elem_type)
