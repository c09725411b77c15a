"""Read a PyTorch checkpoint (`.pth`) into numpy arrays without torch, and without running any of its code.

`torch.save` since torch 1.6 writes an uncompressed zip with one top folder (the file's stem, or `archive`):

    <top>/data.pkl      the pickled object; a tensor is a call to torch._utils._rebuild_tensor_v2 on a
                        persistent id ('storage', torch.<Dtype>Storage, <key>, <location>, <numel>)
    <top>/data/<key>    that storage's raw bytes, in <top>/byteorder's order (little when absent)

Before 1.6 (and with `_use_new_zipfile_serialization=False`) the legacy format: a pickled magic number,
protocol version and system info, then the object (persistent ids ('storage', type, key, location, numel,
view_metadata)), then the pickled list of storage keys, then each storage as <int64 numel><raw bytes>.

A pickle is a program: unpickling calls whatever global it names. Only what a state_dict needs is
resolved (tensor rebuilds, OrderedDict, storage types, as `torch.load(weights_only=True)` allows), each to
a stand-in written here; any other global raises CheckpointError before anything is called.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any, Optional

import numpy as np

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_MAX_DEPTH = 64   # nesting of containers a checkpoint may have: a state_dict has two


class CheckpointError(ValueError):
    """The file is not a checkpoint this reader accepts; the message names the file and the reason."""


class _Storage:
    """A storage's dtype and element count, and (once read) its data."""

    def __init__(self, kind: "_StorageType", numel: int, base: Optional["_Storage"] = None, offset: int = 0):
        self.kind, self.numel, self.base, self.offset = kind, numel, base, offset
        self.data: Optional[np.ndarray] = None

    def __setstate__(self, state):
        raise pickle.UnpicklingError("a storage has no state")

    def array(self) -> np.ndarray:
        if self.base is not None:   # a legacy view into another storage
            return self.base.array()[self.offset:self.offset + self.numel]
        assert self.data is not None
        return self.data


class _StorageType:
    def __init__(self, name: str, dtype: str):
        self.name, self.dtype = name, np.dtype(dtype)
        self.bfloat16 = name == "BFloat16Storage"   # numpy has none: read as uint16, widened to float32

    def __setstate__(self, state):
        raise pickle.UnpicklingError("a storage type has no state")


_STORAGES = {f"{name}Storage": _StorageType(f"{name}Storage", dtype) for name, dtype in [
    ("Float", "<f4"), ("Double", "<f8"), ("Half", "<f2"), ("BFloat16", "<u2"), ("Long", "<i8"), ("Int", "<i4"),
    ("Short", "<i2"), ("Char", "i1"), ("Byte", "u1"), ("Bool", "?")]}


class _Tensor:
    """A tensor to be cut out of its storage once every storage has been read."""

    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage, offset, shape, stride):
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError("a tensor must be rebuilt from a storage")
        if not (_ints(shape) and _ints(stride) and len(shape) == len(stride) and isinstance(offset, int)
                and offset >= 0 and min(stride, default=0) >= 0 and min(shape, default=0) >= 0):
            raise pickle.UnpicklingError(f"a tensor with size {shape!r}, stride {stride!r} and offset {offset!r}")
        self.storage, self.offset, self.shape, self.stride = storage, offset, tuple(shape), tuple(stride)

    def __setstate__(self, state):
        raise pickle.UnpicklingError("a tensor has no state")

    def array(self) -> np.ndarray:
        flat = self.storage.array()
        if 0 in self.shape:
            return np.zeros(self.shape, flat.dtype)
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        if last >= len(flat):
            raise CheckpointError(f"a tensor of size {list(self.shape)} reaches element {last} of a storage of "
                                  f"{len(flat)}")
        view = np.lib.stride_tricks.as_strided(flat[self.offset:], self.shape,
                                               [s * flat.itemsize for s in self.stride], writeable=False)
        out = np.array(view, dtype=flat.dtype.newbyteorder("="))
        if self.storage.kind.bfloat16:
            out = (out.astype(np.uint32) << 16).view(np.float32)
        return out


def _ints(values) -> bool:
    return isinstance(values, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *state):
    return data   # an nn.Parameter is its tensor, for inference


_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): kind for name, kind in _STORAGES.items()},
}


class _Unpickler(pickle.Unpickler):
    """Resolves the globals of _GLOBALS only; storages come from `storage(kind, key, numel)`."""

    def __init__(self, file, source: str, storage):
        super().__init__(file, encoding="utf-8")
        self.source, self.storage = source, storage

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise CheckpointError(
                f"{self.source}: refused: it asks to call {module}.{name}, which a state_dict never needs (only "
                "tensors, OrderedDict and torch storage types are allowed, as torch.load(weights_only=True) "
                "allows). Nothing of it was run. If you trust the file, load it with torch and save only the "
                "weights: torch.save(model.state_dict(), 'weights.pth')")
        return found

    def persistent_load(self, pid) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[4], int) and pid[4] >= 0):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:200]}")
        return self.storage(pid)


def read_checkpoint(path: str | Path) -> Any:
    """The object a `torch.save` file holds, with numpy arrays where it has tensors (dicts, lists and
    tuples kept). Raises CheckpointError, naming the file, for anything else."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(0)
            if head == b"PK\x03\x04":
                return _materialize(_read_zip(f, str(path)), str(path))
            if head[:1] == b"\x80":
                return _materialize(_read_legacy(f, str(path)), str(path))
    except CheckpointError:
        raise
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read it: {err.strerror or err}") from None
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, struct.error, RecursionError, MemoryError) as err:
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint ({type(err).__name__}: {str(err)[:200]})") \
            from None
    raise CheckpointError(f"{path}: not a PyTorch checkpoint (neither the zip format of torch.save nor the legacy "
                          "pickle format)")


def _read_zip(f, source: str) -> Any:
    with zipfile.ZipFile(f) as zf:
        names = zf.namelist()
        pkls = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pkls) != 1:
            raise CheckpointError(f"{source}: a zip, but not one torch.save wrote: expected one <folder>/data.pkl, "
                                  f"found {pkls or 'none'}")
        top = pkls[0][: -len("data.pkl")]
        order = zf.read(f"{top}byteorder").decode() if f"{top}byteorder" in names else "little"
        if order not in ("little", "big"):
            raise CheckpointError(f"{source}: unknown byte order {order[:20]!r}")
        storages: dict[str, _Storage] = {}

        def storage(pid) -> _Storage:
            kind, key, numel = pid[1], str(pid[2]), pid[4]
            if key not in storages:
                dtype = kind.dtype.newbyteorder("<" if order == "little" else ">")
                need = numel * dtype.itemsize
                info = zf.getinfo(f"{top}data/{key}")
                if info.file_size < need:
                    raise CheckpointError(f"{source}: storage {key} holds {info.file_size} bytes, {numel} elements "
                                          f"of {kind.name} need {need}")
                with zf.open(info) as member:   # NOTE: no more than needed: a crafted entry may inflate to GBs
                    raw = member.read(need)
                storages[key] = _Storage(kind, numel)
                storages[key].data = np.frombuffer(raw, dtype, numel)
            return storages[key]

        return _Unpickler(io.BytesIO(zf.read(pkls[0])), source, storage).load()


def _read_legacy(f, source: str) -> Any:
    def plain(what: str):
        value = _Unpickler(f, source, lambda pid: _fail(f"{what} refers to a storage")).load()
        return value

    if plain("the magic number") != _LEGACY_MAGIC:
        raise CheckpointError(f"{source}: a pickle, not a PyTorch checkpoint (no torch.save magic number)")
    plain("the protocol version")
    info = plain("the system info")
    little = info.get("little_endian", True) if isinstance(info, dict) else True
    roots: dict[str, _Storage] = {}
    views: dict[str, _Storage] = {}

    def storage(pid) -> _Storage:
        kind, key, numel = pid[1], str(pid[2]), pid[4]
        root = roots.setdefault(key, _Storage(kind, numel))
        view = pid[5] if len(pid) > 5 else None
        if view is None:
            return root
        view_key, offset, size = view
        return views.setdefault(str(view_key), _Storage(kind, int(size), root, int(offset)))

    obj = _Unpickler(f, source, storage).load()
    keys = plain("the storage list")
    if not isinstance(keys, list):
        raise CheckpointError(f"{source}: the legacy storage list is not a list")
    for key in keys:
        root = roots.get(str(key))
        if root is None:
            raise CheckpointError(f"{source}: storage {key} is listed but never used")
        (numel,) = struct.unpack("<q" if little else ">q", f.read(8))
        dtype = root.kind.dtype.newbyteorder("<" if little else ">")
        raw = f.read(numel * dtype.itemsize)
        if numel != root.numel or len(raw) != numel * dtype.itemsize:
            raise CheckpointError(f"{source}: storage {key}: truncated ({len(raw)} bytes of {root.numel} elements)")
        root.data = np.frombuffer(raw, dtype)
    missing = [k for k, s in roots.items() if s.data is None]
    if missing:
        raise CheckpointError(f"{source}: storage {missing[0]} is used but not in the file")
    return obj


def _fail(message: str):
    raise pickle.UnpicklingError(message)


def _materialize(obj: Any, source: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"{source}: nested more than {_MAX_DEPTH} deep")
    if isinstance(obj, _Tensor):
        return obj.array()
    if isinstance(obj, dict):
        return type(obj)((k, _materialize(v, source, depth + 1)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialize(v, source, depth + 1) for v in obj)
    return obj


_STORAGE_NAMES = {np.dtype("<f4"): "FloatStorage", np.dtype("<f2"): "HalfStorage", np.dtype("<f8"): "DoubleStorage",
                  np.dtype("<i8"): "LongStorage"}


def write_state_dict(path: str | Path, state: dict[str, np.ndarray]) -> Path:
    """Write `state` as `torch.save(state_dict)` does (zip format; torch.load reads it): the checkpoints
    that the tests and the import benchmark feed the importer, written without torch."""
    path = Path(path)
    out = io.BytesIO()
    w = out.write
    w(b"\x80\x02ccollections\nOrderedDict\n)R(")            # PROTO 2; OrderedDict(); MARK
    storages = []
    for key, value in state.items():
        value = np.asarray(value)
        value = np.array(value, dtype=value.dtype.newbyteorder("<"), order="C")   # 0-d stays 0-d
        kind = _STORAGE_NAMES.get(value.dtype)
        if kind is None:
            raise ValueError(f"{key}: dtype {value.dtype} is not one of {sorted(map(str, _STORAGE_NAMES))}")
        _str(w, key)
        w(b"ctorch._utils\n_rebuild_tensor_v2\n((")          # the rebuild; MARK args; MARK persistent id
        _str(w, "storage")
        w(f"ctorch\n{kind}\n".encode())
        _str(w, str(len(storages)))
        _str(w, "cpu")
        _int(w, value.size)
        w(b"tQ")                                             # TUPLE -> BINPERSID
        _int(w, 0)
        _ints_tuple(w, value.shape)
        _ints_tuple(w, tuple(s // max(value.itemsize, 1) for s in value.strides))
        w(b"\x89ccollections\nOrderedDict\n)RtR")          # requires_grad False; hooks OrderedDict(); call
        storages.append(value)
    w(b"u.")                                                 # SETITEMS; STOP
    top = path.stem
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{top}/data.pkl", out.getvalue())
        zf.writestr(f"{top}/byteorder", "little")
        for i, value in enumerate(storages):
            zf.writestr(f"{top}/data/{i}", value.tobytes())
        zf.writestr(f"{top}/version", "3\n")
    return path


def _str(w, s: str) -> None:
    data = s.encode()
    w(b"X" + struct.pack("<I", len(data)) + data)            # BINUNICODE


def _int(w, n: int) -> None:
    if 0 <= n < 2**31:
        w(b"J" + struct.pack("<i", n))                       # BININT
    else:
        data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
        w(b"\x8a" + bytes([len(data)]) + data)              # LONG1


def _ints_tuple(w, values) -> None:
    w(b"(")
    for v in values:
        _int(w, int(v))
    w(b"t")
