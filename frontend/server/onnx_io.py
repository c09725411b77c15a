"""A model's inputs and outputs read from its ONNX file without decoding the weights: the catalog
needs the audio shape of thousands of models, and `onnx.load` of a 48 MB model takes ~190 ms where
walking the protobuf wire format to the graph's inputs and outputs takes ~1 ms."""

from __future__ import annotations

import mmap
from pathlib import Path

from config.assets import AssetError, ModelIO, classify_io


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, start, end) of each length-delimited field of a protobuf message; others skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(buf, pos)
            yield number, pos, pos + length
            pos += length
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")


_GRAPH, _INPUT, _OUTPUT, _INITIALIZER, _TENSOR_NAME = 7, 11, 12, 5, 8


def _scan_io(path: Path):
    """Graph inputs, outputs and initializer names, read without decoding the weights."""
    import onnx

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        graph = next(((a, b) for n, a, b in _fields(buf, 0, len(buf)) if n == _GRAPH), None)
        if graph is None:
            raise ValueError("no graph")
        inputs, outputs, initializers = [], [], set()
        for number, a, b in _fields(buf, *graph):
            if number == _INPUT:
                inputs.append(onnx.ValueInfoProto.FromString(buf[a:b]))
            elif number == _OUTPUT:
                outputs.append(onnx.ValueInfoProto.FromString(buf[a:b]))
            elif number == _INITIALIZER:
                name = next((buf[x:y] for n, x, y in _fields(buf, a, b) if n == _TENSOR_NAME), b"")
                initializers.add(name.decode())
    return inputs, outputs, initializers


def read_model_io(path: Path) -> ModelIO:
    """Read a model's I/O from the ONNX file without creating an inference session."""
    if not path.exists():
        raise AssetError(f"{path}: model file is missing")
    try:
        inputs, outputs, initializers = _scan_io(path)
    except Exception:  # not what the fast scan expects: let onnx itself read (and judge) the file
        import onnx
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as err:  # onnx raises DecodeError and friends on garbage
            raise AssetError(f"{path}: not a readable ONNX model ({type(err).__name__}: {err})") from None
        inputs, outputs = list(model.graph.input), list(model.graph.output)
        initializers = {t.name for t in model.graph.initializer}

    def dims(value) -> list:
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in value.type.tensor_type.shape.dim]

    return classify_io([(v.name, dims(v)) for v in inputs if v.name not in initializers],
                       [(v.name, dims(v)) for v in outputs], str(path))
