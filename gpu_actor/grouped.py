"""An architecture's N-model form: one call runs n frames, frame i with model i's weights.

Every avatar is one architecture with other weights (gpu_actor/model_split.py), so frames of different avatars
could share a device call if each op took its own model's weights per frame. `grouped_graph(arch, n)` is
the architecture at a fixed batch n whose weight inputs are stacked, [n, *shape] (row i: frame i's model's
tensor, so a worker fills a row by copying that model's buffer), and whose weight ops run per frame, as
`torch.vmap` batches a convolution over batched weights (functorch's BatchRulesConvolution.cpp):

    Conv W [Co, Ci/g, k..] group g   x [n, C, H, W] -> [1, n*C, H, W] (a view), W -> [n*Co, Ci/g, k..],
                                     B -> [n*Co], group g*n, the output viewed back as [n, Co, H', W']
    ConvTranspose W [Ci, Co/g, k..]  the same, W -> [n*Ci, Co/g, k..]
    BatchNormalization, InstanceNormalization: the [1, n*C, ...] view with the params stacked [n*C]
    1x1 Conv, pointwise="matmul"     [n, Co, Ci] x [n, Ci, H*W] (+ B [n, Co, 1]): one strided-batched GEMM
    MatMul, Gemm with a weight       a batched MatMul with the weight [n, ..., K, M]
    Add Sub Mul Div PRelu            the weight right-aligned against the activation, [n, 1.., *shape]
    LayerNormalization               normalized without its params, then * scale + bias per frame

Every other op runs on [n, ...] as it is, which is exact only where it keeps frames apart: it is checked
(its axis attributes and its output's shape, inferred at batch n and n+1, whose first axis must be the
batch) and a graph that mixes frames is refused, GroupError naming the node and why. The ops added are
Reshape, Tile, Transpose, MatMul, Mul, Add and the ops rewritten, in the graph's own opset.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from gpu_actor.static_shapes import ShapeError, attribute, constant_value, infer_at_batch, np_dtype

POINTWISE = ("conv", "matmul")
BATCHED, WEIGHT, CONST, META = "batched", "weight", "const", "meta"   # what a tensor holds (see _Grouper)
_INT_BIG = 2 ** 31 - 1    # Slice's "to the end", as exporters write it (INT32_MAX, INT64_MAX)

# Ops that act on each element (broadcasting operands): row i of the output needs row i of the inputs
# as long as no operand without the frames' axis brings an axis of its own in front of it.
_ELEMENTWISE = {
    "Relu", "Sigmoid", "Tanh", "LeakyRelu", "Elu", "Selu", "Celu", "Exp", "Log", "Abs", "Neg", "Sqrt",
    "Reciprocal", "Clip", "HardSigmoid", "HardSwish", "Softplus", "Softsign", "Erf", "Gelu", "Identity",
    "Cast", "CastLike", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Tan", "Not", "IsNaN", "IsInf", "Mish",
    "ThresholdedRelu", "Shrink", "Dropout", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean",
    "Where", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor", "Mod", "PRelu",
    "BitShift",
}
# Ops that take one sample (input 0) at a time; their other inputs must be constants of the graph.
_PER_SAMPLE = {
    "Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool",
    "GlobalLpPool", "LRN", "DepthToSpace", "SpaceToDepth", "BatchNormalization", "InstanceNormalization",
    "GroupNormalization", "LayerNormalization",
}
# Ops with one axis attribute (its default by opset: (before opset, default), ...) that must not be 0.
_AXIS = {
    "Concat": None, "Split": ((99, 0),), "Softmax": ((13, 1), (99, -1)), "LogSoftmax": ((13, 1), (99, -1)),
    "Hardmax": ((13, 1), (99, -1)), "ArgMax": ((99, 0),), "ArgMin": ((99, 0),), "LpNormalization": ((99, -1),),
    "TopK": ((99, -1),), "GatherElements": ((99, 0),),
}
_REDUCE = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}
# Inputs that may be computed from the shapes (Shape -> Gather -> Concat): sizes, not data.
_SIZE_INPUTS = {"Reshape": {1}, "Expand": {1}, "Resize": {1, 2, 3}, "Upsample": {1}, "Slice": {1, 2, 3, 4},
                "Tile": {1}, "Pad": {1, 2}, "Squeeze": {1}, "Unsqueeze": {1}, "ReduceMean": {1}, "ReduceSum": {1},
                "TopK": {1}, "Split": {1}}


_SUBGRAPHS = (5, 10)      # onnx AttributeProto GRAPH, GRAPHS: If, Loop, Scan


class GroupError(ValueError):
    """The architecture cannot run n models per call exactly: the message names the node and why."""


def grouped_graph(architecture, n: int, pointwise: str = "conv") -> bytes:
    """The serialized N-model form of `architecture` (gpu_actor/model_split.Architecture) at batch `n`: its
    data inputs and output with batch n, each weight an input of its own name and shape [n, *shape].
    `pointwise`: "conv" runs 1x1 convolutions as grouped convolutions too, "matmul" as batched MatMuls."""
    import onnx
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n is the frames (and models) per call, >= 1, got {n!r}")
    if pointwise not in POINTWISE:
        raise ValueError(f"pointwise must be one of {POINTWISE}, got {pointwise!r}")
    model = onnx.load_from_string(architecture.graph)
    grouper = _Grouper(model, architecture, n, pointwise)
    grouper.classify_inputs()
    for node in model.graph.node:
        grouper.visit(node)
    return grouper.finish()


PACKED = "packed_weights"


def packed_graph(grouped: bytes, architecture, n: int) -> bytes:
    """`grouped` (grouped_graph's, at batch n) with one input for every weight: PACKED [n, total], row i
    model i's whole weight buffer (gpu_actor/weights.Weights: each tensor at its aligned offset), so a
    worker fills a row with one copy instead of one per tensor; each weight is sliced out of it in the
    graph (a copy on the device: n x the weights' bytes a call). Only where every weight has one dtype
    (GroupError otherwise: the buffer's bytes would need a bitcast ONNX has no op for)."""
    import onnx
    from onnx import helper, numpy_helper

    from gpu_actor.weights import layout
    dtypes = {np.dtype(d) for d in architecture.dtypes}
    if len(dtypes) != 1:
        raise GroupError(f"weights of {len(dtypes)} dtypes ({', '.join(sorted(d.name for d in dtypes))}) "
                         "cannot share one packed input")
    (dtype,) = dtypes
    offsets, total = layout(architecture.shapes, architecture.dtypes)
    model = onnx.load_from_string(grouped)
    graph = model.graph
    weights = set(architecture.weights)
    kept = [v for v in graph.input if v.name not in weights]
    del graph.input[:]
    graph.input.extend(kept)
    graph.input.append(helper.make_tensor_value_info(
        PACKED, helper.np_dtype_to_tensor_dtype(dtype), [n, total // dtype.itemsize]))
    nodes, inits = [], []
    bounds_as_inputs = _opset(model) >= 10   # (Slice took its bounds as attributes before opset 10)
    for k, (name, shape, offset) in enumerate(zip(architecture.weights, architecture.shapes, offsets)):
        start, size = offset // dtype.itemsize, int(np.prod(shape, dtype=np.int64))
        consts = {"starts": [start], "ends": [start + size], "axes": [1], "shape": [n, *shape]}
        if not bounds_as_inputs:
            consts = {"shape": consts["shape"]}
        names = {key: f"{PACKED}_{key}_{k}" for key in consts}
        inits += [numpy_helper.from_array(np.asarray(v, np.int64), names[key]) for key, v in consts.items()]
        flat = f"{PACKED}_row_{k}"
        if bounds_as_inputs:
            nodes.append(helper.make_node("Slice", [PACKED, names["starts"], names["ends"], names["axes"]], [flat]))
        else:
            nodes.append(helper.make_node("Slice", [PACKED], [flat], starts=[start], ends=[start + size], axes=[1]))
        nodes.append(helper.make_node("Reshape", [flat, names["shape"]], [name]))
    graph.initializer.extend(inits)
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)
    return model.SerializeToString()


def stacked_feeds(architecture, weight_lists: Sequence[Sequence[np.ndarray]]) -> dict[str, np.ndarray]:
    """The grouped graph's weight inputs for n models: `weight_lists[i]` is model i's weights in
    `architecture.weights` order (Architecture.weights_of gives them); row i of each is model i's."""
    if not weight_lists:
        raise ValueError("stacked_feeds needs the weights of at least one model")
    feeds = {}
    for k, (name, shape, dtype) in enumerate(zip(architecture.weights, architecture.shapes, architecture.dtypes)):
        rows = [np.asarray(weights[k]) for weights in weight_lists]
        for i, row in enumerate(rows):
            if row.shape != tuple(shape):
                raise ValueError(f"model {i}'s weight {name} is {list(row.shape)}, its architecture needs "
                                 f"{list(shape)}")
        feeds[name] = np.stack(rows).astype(dtype, copy=False)
    return feeds


def _probe(model, inputs, batch: int, strict: bool = True) -> tuple[dict, dict]:
    try:
        return infer_at_batch(model, inputs, batch, strict)
    except ShapeError as err:
        raise GroupError(str(err)) from None


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


class _Grouper:
    """Walks the graph once, in order, knowing of each tensor what it holds:

        batched  [n, ...], row i is frame i's (the data inputs and what is computed from them)
        weight   a weight input, [n, *shape] in the grouped graph (row i: model i's)
        const    the same for every frame and model (initializers, Constant, ops on those)
        meta     computed from the batch size (Shape of an activation): may only size things
    """

    def __init__(self, model, architecture, n: int, pointwise: str):
        self.model, self.graph, self.n, self.pointwise = model, model.graph, n, pointwise
        self.opset = _opset(model)
        self.weights = dict(zip(architecture.weights, (tuple(s) for s in architecture.shapes)))
        self.data = [v.name for v in self.graph.input if v.name not in self.weights]
        ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in self.graph.input}
        flat = [name for name in self.data if ranks[name] == 0]
        if flat:
            raise GroupError(f"input {flat[0]} has no batch axis (a scalar): the grouped form stacks frames on axis 0")
        self.shape, self.types = _probe(model, self.data, n)
        # NOTE: a second batch size tells the frames' axis from an axis that is n by chance (a Reshape to a
        # constant [n, -1]); a graph that only runs at batch n fails there, which is checked node by node
        self.shape_next, _ = _probe(model, self.data, n + 1, strict=False)
        self.kind: dict[str, str] = {}
        self.values: dict[str, np.ndarray] = {}
        self.nodes: list = []
        self.inits: list = []
        self.taken = {v.name for v in self.graph.input} | {t.name for t in self.graph.initializer} | \
            {o for node in self.graph.node for o in node.output}
        self._cache: dict = {}

    # -- what each tensor holds ---------------------------------------------------------------------------

    def classify_inputs(self) -> None:
        from onnx import numpy_helper
        for name in self.weights:
            self.kind[name] = WEIGHT
        for init in self.graph.initializer:
            self.kind[init.name] = CONST
            self.values[init.name] = numpy_helper.to_array(init)
        for name in self.data:
            self.kind[name] = BATCHED
            self._check_batched(name, f"input {name}")
        self.kind[""] = CONST

    def _check_batched(self, name: str, what: str) -> None:
        """A batched tensor's shape is static and its first axis is the batch, at batch n and at n + 1."""
        a, b = self.shape.get(name), self.shape_next.get(name)
        if a is None or None in a:
            raise GroupError(f"{what}: the shape of {name} is not static at a fixed batch ({a} at batch {self.n}): "
                             "the grouped form needs every activation's shape")
        if b is None or None in b:
            raise GroupError(f"{what}: {name} is {list(a)} at batch {self.n} but has no static shape at batch "
                             f"{self.n + 1}: the graph holds the batch size fixed (it mixes frames)")
        if not a or a[0] != self.n or b[0] != self.n + 1 or a[1:] != b[1:]:
            raise GroupError(f"{what}: {name} is {list(a)} at batch {self.n} and {list(b)} at batch {self.n + 1}: "
                             "its first axis is not the frames' (the op mixes frames)")

    def visit(self, node) -> None:
        where = f"{node.op_type} node {node.name!r}"
        kinds = [self.kind.get(x, CONST) for x in node.input]
        if node.domain not in ("", "ai.onnx") or any(a.type in _SUBGRAPHS for a in node.attribute):
            if set(kinds) - {CONST}:
                raise GroupError(f"{where}: an op of domain {node.domain!r} or with subgraphs on activations is "
                                 "not known to keep frames apart")
            return self._keep(node, CONST)
        if WEIGHT in kinds:
            rewrite = _REWRITES.get(node.op_type)
            if rewrite is None:
                raise GroupError(f"{where}: it takes weight {node.input[kinds.index(WEIGHT)]}, and only "
                                 f"{', '.join(sorted(_REWRITES))} can take a weight per frame")
            if BATCHED not in kinds:
                raise GroupError(f"{where}: weight {node.input[kinds.index(WEIGHT)]} is used as plain data (no "
                                 "operand of this node is a frame's activation)")
            rewrite(self, node, where)
            return self._batched_outputs(node, where)
        if BATCHED in kinds:
            for index, kind in enumerate(kinds):
                if kind == META and index not in _SIZE_INPUTS.get(node.op_type, ()):
                    raise GroupError(f"{where}: its input {index} ({node.input[index]}) is computed from the batch "
                                     "size and used as data: the grouped graph's batch is n, a frame's is 1")
            reason = self._keeps_frames_apart(node, kinds)
            if reason:
                raise GroupError(f"{where}: {reason}")
            if node.op_type in ("Shape", "Size"):
                return self._keep(node, META)
            self._keep(node, BATCHED)
            return self._batched_outputs(node, where)
        self._keep(node, META if META in kinds else CONST)

    def _keep(self, node, kind: str) -> None:
        self.nodes.append(node)
        for out in node.output:
            self.kind[out] = kind
        if node.op_type == "Constant" and node.output:
            value = constant_value(node)
            if value is not None:
                self.values[node.output[0]] = value

    def _batched_outputs(self, node, where: str) -> None:
        for out in node.output:
            if out:
                self.kind[out] = BATCHED
                self._check_batched(out, where)

    # -- ops left as they are -----------------------------------------------------------------------------

    def _keeps_frames_apart(self, node, kinds: list[str]) -> Optional[str]:
        """None where `node` (with a batched input) computes each frame from that frame alone, else why not."""
        op = node.op_type
        rank = len(self.shape[next(x for x, k in zip(node.input, kinds) if k == BATCHED)])
        if op in _ELEMENTWISE:
            out_rank = len(self.shape.get(node.output[0]) or ()) or rank
            for name, kind in zip(node.input, kinds):
                s = self.shape.get(name)
                if kind == CONST and name and s is not None and len(s) >= out_rank and s[0] != 1:
                    return f"operand {name} {list(s)} has an axis in line with the frames' of size {s[0]}"
            return None
        if op in _PER_SAMPLE:
            if kinds[0] != BATCHED or BATCHED in kinds[1:]:
                return "its parameters are computed from the frames"
            if op == "BatchNormalization" and _training(node):
                return "it runs in training mode (statistics over the batch)"
            if op == "MaxPool" and len(node.output) > 1 and node.output[1]:
                return "its indices count across the whole batch (a frame's are offset by its row)"
            if op == "LayerNormalization" and self._axis(attribute(node, "axis", -1), rank) == 0:
                return "it normalizes over the frames' axis (axis 0)"
            return None
        if op in _AXIS:
            return self._axis_check(node, kinds, rank)
        if op in _REDUCE:
            return self._reduce_check(node, rank)
        if op in ("Shape", "Size"):
            return None
        if op == "Flatten":
            flat = self._axis(attribute(node, "axis", 1), rank) == 1
            return None if flat else "it flattens the frames' axis with others"
        if op == "Transpose":
            perm = attribute(node, "perm", list(range(rank))[::-1])
            return None if perm[0] == 0 else f"perm {list(perm)} moves the frames' axis"
        if op in ("Squeeze", "Unsqueeze"):
            axes = attribute(node, "axes") if self.opset < 13 else self._value(node, 1)
            if axes is None:
                return "its axes are not a constant of the graph (without axes it squeezes a batch of 1)"
            out_rank = rank + len(axes) if op == "Unsqueeze" else rank
            return None if 0 not in {self._axis(a, out_rank) for a in np.ravel(axes)} else "it acts on axis 0"
        if op in ("Resize", "Upsample"):
            scales = self._scales(node)
            if scales is not None and np.size(scales) and np.ravel(scales)[0] != 1:
                return f"scales {list(np.ravel(scales))} resize the frames' axis"
        if op in ("Reshape", "Expand", "Resize", "Upsample"):
            return None if kinds[0] == BATCHED else "its data is not a frame's activation"
        if op == "Tile":
            repeats = self._value(node, 1)
            return None if repeats is not None and repeats[0] == 1 else "it repeats along the frames' axis"
        if op == "Pad":
            pads = attribute(node, "pads") if self.opset < 11 else self._value(node, 1)
            if pads is None or kinds[0] != BATCHED:
                return "its pads are not a constant of the graph"
            return None if pads[0] == 0 and pads[rank] == 0 else "it pads the frames' axis"
        if op == "Slice":
            return self._slice_check(node, rank)
        if op == "Gather":
            axis = self._axis(attribute(node, "axis", 0), len(self.shape[node.input[0]]))
            if kinds[0] == BATCHED:
                return None if axis != 0 and kinds[1] != BATCHED else "it gathers along or by the frames' axis"
            return None if axis == 0 else "it gathers a constant by the frames' indices along another axis"
        if op == "MatMul":
            a, b = (len(self.shape[x]) for x in node.input)
            if kinds[1] == BATCHED and b < 3 or kinds[0] == BATCHED and a < 2:
                return "the frames' axis is one of its matrix axes"
            return None
        if op == "Gemm":
            if kinds[0] != BATCHED or BATCHED in kinds[1:] or attribute(node, "transA", 0):
                return "the frames' axis is not its row axis (input A, transA 0)"
            return None
        return "this op is not known to keep frames apart"

    def _axis(self, axis: int, rank: int) -> int:
        return axis + rank if axis < 0 else axis

    def _value(self, node, index: int):
        if index >= len(node.input) or not node.input[index]:
            return None
        return self.values.get(node.input[index])

    def _axis_check(self, node, kinds, rank: int) -> Optional[str]:
        defaults = _AXIS[node.op_type]
        default = next((d for before, d in defaults if self.opset < before), None) if defaults else None
        axis = attribute(node, "axis", default)
        if axis is None:
            return "it has no axis"
        if node.op_type == "GatherElements" and kinds[1] == BATCHED and kinds[0] != BATCHED:
            return "it gathers from a constant by the frames' indices"
        return None if self._axis(axis, rank) != 0 else f"it acts along axis {axis}, the frames'"

    def _reduce_check(self, node, rank: int) -> Optional[str]:
        axes = attribute(node, "axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = self._value(node, 1)
            if axes is None:
                return "its axes are not a constant of the graph"
        if axes is None or not np.size(axes):
            if attribute(node, "noop_with_empty_axes", 0):
                return None
            return "without axes it reduces every axis, the frames' among them"
        axes = {self._axis(int(a), rank) for a in np.ravel(axes)}
        return None if 0 not in axes else "it reduces along axis 0, the frames'"

    def _scales(self, node):
        if self.opset < 9:
            return attribute(node, "scales")
        return self._value(node, 2 if node.op_type == "Resize" and self.opset >= 11 else 1)

    def _slice_check(self, node, rank: int) -> Optional[str]:
        if self.opset < 10:
            starts, ends, axes = (attribute(node, name) for name in ("starts", "ends", "axes"))
            steps = None
        else:
            starts, ends, axes, steps = (self._value(node, i) for i in (1, 2, 3, 4))
            if len(node.input) > 3 and node.input[3] and axes is None:
                return "its axes are not a constant of the graph"
        if axes is None and starts is None:
            return "its starts are not a constant of the graph, so neither are the axes it slices"
        axes = list(range(len(starts))) if axes is None else [self._axis(int(a), rank) for a in np.ravel(axes)]
        if 0 not in axes:
            return None
        k = axes.index(0)
        if starts is None or ends is None:
            return "its starts and ends along the frames' axis are not constants of the graph"
        start, end = int(np.ravel(starts)[k]), int(np.ravel(ends)[k])
        step = 1 if steps is None else int(np.ravel(steps)[k])
        # NOTE: only the whole axis, in order, is a frame-for-frame slice at every batch size
        if (start == 0 or start <= -_INT_BIG) and end >= _INT_BIG and step == 1:
            return None
        return f"it slices the frames' axis ({start}:{end}:{step})"

    # -- building the grouped graph ------------------------------------------------------------------------

    def fresh(self, hint: str) -> str:
        base, k = f"{hint}/grouped", 0
        while f"{base}{k}" in self.taken:
            k += 1
        self.taken.add(f"{base}{k}")
        return f"{base}{k}"

    def emit(self, op: str, inputs: list[str], output: Optional[str] = None, hint: str = "", **attrs) -> str:
        from onnx import helper
        out = output or self.fresh(hint or op)
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.fresh(f"{hint or op}.{op}"), **attrs))
        return out

    def constant(self, array: np.ndarray, hint: str) -> str:
        from onnx import numpy_helper
        key = ("const", array.dtype.str, array.shape, array.tobytes())
        if key not in self._cache:
            name = self.fresh(hint)
            self.inits.append(numpy_helper.from_array(array, name))
            self._cache[key] = name
        return self._cache[key]

    def reshape(self, x: str, shape: Sequence[int], output: Optional[str] = None) -> str:
        """`x` viewed as `shape` (a Reshape: free on a contiguous tensor); shared where asked twice, none
        where `x` has that shape already."""
        known = (self.n, *self.weights[x]) if x in self.weights else self.shape.get(x)
        if output is None and known == tuple(shape):
            return x
        target = self.constant(np.array(list(shape), np.int64), "shape")
        if output:
            return self.emit("Reshape", [x, target], output)
        key = ("reshape", x, tuple(shape))
        if key not in self._cache:
            self._cache[key] = self.emit("Reshape", [x, target], hint=x)
        return self._cache[key]

    def per_model(self, name: str, where: str) -> tuple[str, tuple[int, ...]]:
        """A weight op's parameter as [n, *shape] (row i: model i's) and its per-model shape: a weight as it
        is, a constant of the graph repeated n times."""
        kind = self.kind.get(name, CONST)
        if kind == WEIGHT:
            return name, self.weights[name]
        if kind != CONST:
            raise GroupError(f"{where}: its parameter {name} is computed from the frames: only weights and "
                             "constants can be a weight op's parameters")
        shape = self.shape.get(name) or (self.values[name].shape if name in self.values else None)
        if shape is None or None in shape:
            raise GroupError(f"{where}: the shape of its parameter {name} is not static")
        one = self.reshape(name, (1, *shape))
        key = ("tile", name)
        if key not in self._cache:
            self._cache[key] = self.emit("Tile", [one, self.constant(np.array([self.n] + [1] * len(shape), np.int64),
                                                                      "repeats")], hint=name)
        return self._cache[key], tuple(shape)

    def broadcast(self, name: str, rank: int, where: str) -> str:
        """A weight operand of an elementwise op on an activation of `rank`, right-aligned against it and
        stacked: [n, 1.., *shape] (a leading 1 in line with the frames' axis dropped)."""
        stacked, shape = self.per_model(name, where)
        if len(shape) > rank or len(shape) == rank and shape[0] != 1:
            raise GroupError(f"{where}: weight {name} {list(shape)} has an axis in line with the frames' axis (the "
                             f"activation has rank {rank}): only weights that broadcast over the frames group")
        if len(shape) == rank:
            shape = shape[1:]
        return self.reshape(stacked, (self.n, *[1] * (rank - 1 - len(shape)), *shape))

    def finish(self) -> bytes:
        import onnx
        from onnx import helper
        for value in self.graph.output:
            if self.kind.get(value.name) != BATCHED:
                raise GroupError(f"output {value.name} is a {self.kind.get(value.name, 'constant')} tensor, not a "
                                 "frame's activation (a weight or a constant as an output does not group)")
        graph = self.graph
        inputs = [helper.make_tensor_value_info(name, self.types[name], list(self.shape[name])) for name in self.data]
        inputs += [helper.make_tensor_value_info(v.name, v.type.tensor_type.elem_type, [self.n, *self.weights[v.name]])
                   for v in graph.input if v.name in self.weights]
        outputs = [helper.make_tensor_value_info(v.name, self.types[v.name], list(self.shape[v.name]))
                   for v in graph.output]
        new = helper.make_graph(self.nodes, f"{graph.name}_x{self.n}", inputs, outputs,
                                [*graph.initializer, *self.inits])
        model = helper.make_model(new, opset_imports=list(self.model.opset_import))
        # NOTE: IR 4 at least: before it every initializer had to be listed as a graph input too, and the
        # form adds initializers of its own (Reshape shapes)
        model.ir_version = max(self.model.ir_version, 4)
        model.producer_name = "lipsync-serve.grouped"
        onnx.checker.check_model(model)
        return model.SerializeToString()


# -- weight ops, rewritten per frame ---------------------------------------------------------------------------

def _conv(g: _Grouper, node, where: str) -> None:
    x, out = node.input[0], node.output[0]
    xs, ys = g.shape[x], g.shape[out]
    w, wshape = g.per_model(node.input[1], where)
    b = g.per_model(node.input[2], where)[0] if len(node.input) > 2 and node.input[2] else None
    group = attribute(node, "group", 1)
    if g.pointwise == "matmul" and node.op_type == "Conv" and _pointwise(node, wshape, group):
        # NOTE: [n, Co, Ci] x [n, Ci, H*W]: one strided-batched GEMM instead of a grouped convolution
        x3 = g.reshape(x, (g.n, xs[1], int(np.prod(xs[2:], dtype=np.int64))))
        y = g.emit("MatMul", [g.reshape(w, (g.n, wshape[0], wshape[1])), x3], hint=out)
        if b is not None:
            y = g.emit("Add", [y, g.reshape(b, (g.n, wshape[0], 1))], hint=out)
        g.reshape(y, ys, output=out)
        return
    if node.op_type == "ConvTranspose":
        output_shape = attribute(node, "output_shape")
        if output_shape is not None and len(output_shape) != len(xs) - 2:
            raise GroupError(f"{where}: output_shape {list(output_shape)} is not its {len(xs) - 2} spatial dims")
    attrs = {a.name: attribute(node, a.name) for a in node.attribute if a.name != "group"}
    inputs = [g.reshape(x, (1, g.n * xs[1], *xs[2:])), g.reshape(w, (g.n * wshape[0], *wshape[1:]))]
    if b is not None:
        inputs.append(g.reshape(b, (g.n * ys[1],)))
    y = g.emit(node.op_type, inputs, hint=out, group=group * g.n, **attrs)
    g.reshape(y, ys, output=out)


def _pointwise(node, wshape: tuple[int, ...], group: int) -> bool:
    """A 1x1 convolution of stride 1 and no padding: a matrix product per frame."""
    ones = [1] * (len(wshape) - 2)
    return (group == 1 and list(wshape[2:]) == ones and list(attribute(node, "strides", ones)) == ones
            and not any(attribute(node, "pads", [])))


def _channels(g: _Grouper, node, where: str, params: range) -> None:
    """BatchNormalization, InstanceNormalization: the frames folded into the channels."""
    if _training(node):
        raise GroupError(f"{where}: it runs in training mode (statistics over the batch)")
    x, out = node.input[0], node.output[0]
    xs = g.shape[x]
    inputs = [g.reshape(x, (1, g.n * xs[1], *xs[2:]))]
    for i in params:
        stacked, shape = g.per_model(node.input[i], where)
        inputs.append(g.reshape(stacked, (g.n * int(np.prod(shape, dtype=np.int64)),)))
    attrs = {a.name: attribute(node, a.name) for a in node.attribute}
    g.reshape(g.emit(node.op_type, inputs, hint=out, **attrs), g.shape[out], output=out)


def _training(node) -> bool:
    """BatchNormalization's training mode (opset 14's attribute, or the outputs of the running statistics):
    it normalizes by the batch's statistics."""
    return bool(attribute(node, "training_mode", 0)) or sum(1 for o in node.output if o) > 1


def _layer_norm(g: _Grouper, node, where: str) -> None:
    """Normalized with a scale of ones and no bias, then the frame's model's scale and bias."""
    if sum(1 for o in node.output if o) > 1:
        raise GroupError(f"{where}: its mean and inverse deviation outputs are used")
    x, out = node.input[0], node.output[0]
    rank = len(g.shape[x])
    if g._axis(attribute(node, "axis", -1), rank) == 0:
        raise GroupError(f"{where}: it normalizes over the frames' axis (axis 0)")
    scale_shape = g.shape.get(node.input[1])
    ones = g.constant(np.ones(scale_shape, np_dtype(g.types[node.input[1]])), "ones")
    attrs = {a.name: attribute(node, a.name) for a in node.attribute}
    y = g.emit("LayerNormalization", [x, ones], hint=out, **attrs)
    has_bias = len(node.input) > 2 and node.input[2]
    y = g.emit("Mul", [y, g.broadcast(node.input[1], rank, where)], None if has_bias else out, hint=out)
    if has_bias:
        g.emit("Add", [y, g.broadcast(node.input[2], rank, where)], out)


def _elementwise(g: _Grouper, node, where: str) -> None:
    """Add Sub Mul Div PRelu with a weight operand: the weight stacked, broadcasting per frame."""
    kinds = [g.kind.get(x, CONST) for x in node.input]
    if node.op_type == "PRelu" and kinds[0] != BATCHED:
        raise GroupError(f"{where}: its input X is not a frame's activation")
    rank = max(len(g.shape[x]) for x, k in zip(node.input, kinds) if k == BATCHED)
    inputs = [x if k != WEIGHT else g.broadcast(x, rank, where) for x, k in zip(node.input, kinds)]
    g.emit(node.op_type, inputs, node.output[0])


def _matmul(g: _Grouper, node, where: str) -> None:
    """A batched MatMul: the weight [n, (1..,) K, M] against the activation [n, ..., P, K] (or the weight
    [n, (1..,) M, K] in front of the activation [n, ..., K, P])."""
    kinds = [g.kind.get(x, CONST) for x in node.input]
    j = kinds.index(WEIGHT)
    x, out = node.input[1 - j], node.output[0]
    if kinds[1 - j] != BATCHED:
        raise GroupError(f"{where}: both operands are weights or constants: a weight used as plain data")
    xs = g.shape[x]
    stacked, ws = g.per_model(node.input[j], where)
    if len(xs) < (3 if j == 0 else 2):
        raise GroupError(f"{where}: the activation {x} {list(xs)} has its frames' axis as a matrix axis: it has no "
                         "batch axis of its own")
    # NOTE: a vector weight is a [K, 1] (or [1, K]) matrix and an activation [n, K] is [n, 1, K]: the
    # product then has an axis more than the node's output, which the last Reshape takes away
    matrix = ws if len(ws) >= 2 else ((ws[0], 1) if j == 1 else (1, ws[0]))
    x3 = xs if len(xs) >= 3 else (g.n, 1, xs[1])
    x_used = x if len(xs) >= 3 else g.reshape(x, x3)
    leading = len(x3) - 2   # the activation's batch axes, the frames' first
    extra = tuple(matrix[:-2])
    if len(extra) > leading or len(extra) == leading and extra and extra[0] != 1:
        raise GroupError(f"{where}: weight {node.input[j]} {list(ws)} has an axis in line with the frames' axis")
    if len(extra) == leading:
        extra = extra[1:]
    w = g.reshape(stacked, (g.n, *[1] * (leading - 1 - len(extra)), *extra, *matrix[-2:]))
    operands = [x_used, w] if j == 1 else [w, x_used]
    same = len(xs) >= 3 and len(ws) >= 2
    y = g.emit("MatMul", operands, out if same else None, hint=out)
    if not same:
        g.reshape(y, g.shape[out], output=out)


def _gemm(g: _Grouper, node, where: str) -> None:
    """Y = alpha A B + beta C, A [n, K] a frame's activation per row: a batched MatMul where B is a weight,
    then alpha, then beta C with C stacked where it is a weight."""
    kinds = [g.kind.get(x, CONST) for x in node.input]
    a, out = node.input[0], node.output[0]
    if kinds[0] != BATCHED or attribute(node, "transA", 0):
        raise GroupError(f"{where}: input A is not the frames' activation with transA 0 (weight as A, or "
                         "the frames' axis as its K axis)")
    alpha, beta, trans_b = attribute(node, "alpha", 1.0), attribute(node, "beta", 1.0), attribute(node, "transB", 0)
    dtype = np_dtype(g.types[out])
    ys = g.shape[out]
    if kinds[1] == WEIGHT:
        w = g.per_model(node.input[1], where)[0]
        if trans_b:
            w = g.emit("Transpose", [w], hint=out, perm=[0, 2, 1])
        y = g.emit("MatMul", [g.reshape(a, (g.n, 1, g.shape[a][1])), w], hint=out)
        y = g.reshape(y, ys)
        if alpha != 1.0:
            y = g.emit("Mul", [y, g.constant(np.array(alpha, dtype), "alpha")], hint=out)
    else:
        if kinds[1] != CONST:
            raise GroupError(f"{where}: input B is computed from the frames")
        y = g.emit("Gemm", [a, node.input[1]], hint=out, alpha=alpha, transB=trans_b)
    if len(node.input) < 3 or not node.input[2]:
        g.emit("Identity", [y], out)
        return
    c = node.input[2]
    if kinds[2] == WEIGHT:
        c = g.broadcast(c, 2, where)
    elif kinds[2] == META or kinds[2] == CONST and len(g.shape[c]) == 2 and g.shape[c][0] != 1:
        raise GroupError(f"{where}: input C {c} {list(g.shape.get(c) or [])} has an axis in line with the frames'")
    if beta != 1.0:
        c = g.emit("Mul", [c, g.constant(np.array(beta, dtype), "beta")], hint=out)
    g.emit("Add", [y, c], out)


_REWRITES = {
    "Conv": _conv, "ConvTranspose": _conv, "MatMul": _matmul, "Gemm": _gemm, "LayerNormalization": _layer_norm,
    "BatchNormalization": lambda g, node, where: _channels(g, node, where, range(1, 5)),
    "InstanceNormalization": lambda g, node, where: _channels(g, node, where, range(1, 3)),
    **{op: _elementwise for op in ("Add", "Sub", "Mul", "Div", "PRelu")},
}
