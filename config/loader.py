"""YAML file -> validated `Config`, with one error message naming the file and the key path."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Union

import msgspec
import msgspec.inspect as mi

from config.schema import Config

log = logging.getLogger(__name__)
# Keys a server no longer reads: a file that sets one still loads (a warning says why it is ignored).
RETIRED = {
    ("inference", "batch_memory_bytes"): "a CPU worker runs one frame per onnxruntime call whatever the batch, so a "
                                         "request's memory is one frame's; a GPU worker runs at its prepared sizes",
    ("inference", "tensorrt"): "its gain was never measured; GPU workers run on the CUDA provider",
}


class ConfigError(ValueError):
    """A configuration the server refuses to start with; the message says what to change."""


_PATH = re.compile(r" - at (?:`key` in )?`\$(?P<path>[^`]*)`$")


def _key_path(raw: str) -> list[str | int]:
    """Turn msgspec's `$.a.b[0]` (minus the `$`) into ['a', 'b', 0]."""
    parts: list[str | int] = []
    for name, quoted, index, hidden in re.findall(r"\.([^.\[]+)|\[\'([^']*)\'\]|\[(\d+)\]|\[(\.\.\.)\]", raw):
        parts.append(int(index) if index else (... if hidden else (name or quoted)))
    return parts


def _resolve_hidden_keys(data: Any, parts: list) -> list[str | int]:
    """msgspec writes a mapping's key as `[...]`: find the entry that fails validation."""
    resolved: list[str | int] = []
    t: Any = mi.type_info(Config)
    for part in parts:
        if part is ... and isinstance(data, dict) and isinstance(_schema_at(t, resolved), mi.DictType):
            python_type = _python_type(_schema_at(t, resolved).value_type)
            for key, value in data.items():
                try:
                    if python_type is not None:
                        msgspec.convert(value, python_type, strict=True)
                except msgspec.ValidationError:
                    part = key
                    break
        resolved.append(part)
        found, data = _lookup(data, [part])
        if not found:
            resolved.extend(parts[len(resolved):])
            break
    return resolved


def _lookup(data: Any, parts: list[str | int]) -> tuple[bool, Any]:
    for part in parts:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data


def _python_type(t: mi.Type) -> Any:
    """The Python type to validate one mapping value with (structs and strings are all we use)."""
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    types = [m.cls if isinstance(m, mi.StructType) else str if isinstance(m, mi.StrType) else None for m in members]
    if None in types:
        return None
    return Union[tuple(types)] if len(types) > 1 else types[0]


def _container(t: mi.Type, part) -> mi.Type:
    """The member of a union that `part` (a key or an index) can step into."""
    if not isinstance(t, mi.UnionType):
        return t
    kinds = (mi.VarTupleType, mi.ListType) if isinstance(part, int) else (mi.StructType, mi.DictType)
    return next((u for u in t.types if isinstance(u, kinds)), t)


def _schema_at(t: mi.Type, parts: list[str | int]) -> mi.Type | None:
    """The schema type of the value at `parts`, following structs, lists and mappings."""
    for part in parts:
        t = _container(t, part)
        if isinstance(t, mi.StructType):
            t = next((f.type for f in t.fields if f.name == part), None)
        elif isinstance(t, (mi.VarTupleType, mi.ListType)):
            t = t.item_type
        elif isinstance(t, mi.DictType):
            t = t.value_type
        else:
            return None
        if t is None:
            return None
    return t


def _bounds(t: mi.IntType | mi.FloatType) -> str:
    marks = [(">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le)]
    return " " + " and ".join(f"{op} {v}" for op, v in marks if v is not None) if any(v is not None for _, v in marks) else ""


def _describe(t: mi.Type) -> str:
    """A schema type in words: IntType(ge=1) -> 'an integer >= 1'."""
    if isinstance(t, mi.IntType):
        return "an integer" + _bounds(t)
    if isinstance(t, mi.FloatType):
        return "a number" + _bounds(t)
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, mi.StrType):
        return f"a string matching {t.pattern}" if t.pattern else "a string"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in sorted(t.values, key=str))
    if isinstance(t, mi.NoneType):
        return "null"
    if isinstance(t, (mi.VarTupleType, mi.ListType)):
        return f"a list of {_describe(t.item_type).removeprefix('a ').removeprefix('an ')}s"
    if isinstance(t, (mi.DictType, mi.StructType)):
        return "a mapping"
    if isinstance(t, mi.UnionType):
        return " or ".join(_describe(u) for u in t.types)
    return str(t)


def _format_error(source: str, data: Any, err: msgspec.ValidationError) -> str:
    text = str(err)
    match = _PATH.search(text)
    message = text[: match.start()] if match else text
    parts = _resolve_hidden_keys(data, _key_path(match.group("path"))) if match else []
    where = ".".join(str(p) for p in parts)
    unknown = re.match(r"Object contains unknown field `(.+)`", message)
    if unknown:
        where = ".".join(str(p) for p in [*parts, unknown.group(1)])
        return f"{source}: {where}: unknown key (check its spelling against config/default.yaml)"
    missing = re.match(r"Object missing required field `(.+)`", message)
    if missing:
        where = ".".join(str(p) for p in [*parts, missing.group(1)])
        return f"{source}: {where}: required key is missing"
    if match and "`key` in" in match.group(0):
        keys = _lookup(data, parts)[1] or {}
        t = _schema_at(mi.type_info(Config), parts)
        bad = next((k for k in keys if not isinstance(k, str) or not re.match(t.key_type.pattern or "", k)), None)
        return f"{source}: {where}: key {bad!r} is not valid: expected {_describe(t.key_type)}"
    found, value = _lookup(data, parts)
    t = _schema_at(mi.type_info(Config), parts)
    expected = _describe(t) if t is not None else message
    got = f", got {value!r}" if found else ""
    return f"{source}: {where or '(top level)'}: expected {expected}{got}"


def parse_config(data: Any, source: str = "<config>", base_dir: str = ".") -> Config:
    """Validate an already-parsed YAML document. None (an empty file) means all defaults."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    if "base_dir" in data:
        raise ConfigError(f"{source}: base_dir: unknown key (paths resolve against the file's directory)")
    data = _without_retired(data, source)
    try:
        config = msgspec.convert({**data, "base_dir": base_dir}, type=Config, strict=True)
    except msgspec.ValidationError as err:
        raise ConfigError(_format_error(source, data, err)) from None
    _check_bridge_keys(config, source)
    _check_shared_binds(config, source)
    return config


def _shared(endpoint: str) -> bool:
    """An endpoint several processes can bind (SO_REUSEPORT): tcp:// with a fixed port."""
    return endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] not in ("0", "*")


def _check_shared_binds(config: Config, source: str) -> None:
    """Several client-facing processes (a GPU host's bridges) share each bind through SO_REUSEPORT,
    which TCP has and ipc sockets do not."""
    b = config.bridge
    if b.processes > 1 and not _shared(b.bind):
        raise ConfigError(f"{source}: bridge.processes: {b.processes} processes share bridge.bind, which only a "
                          f"tcp:// endpoint of a fixed port allows; {b.bind!r} is not one (bind tcp://HOST:PORT, or "
                          "set bridge.processes: 1)")
    f = config.frontend
    if f.processes > 1:
        other = next((e for e in f.bind if not _shared(e)), None)
        if other is not None:
            raise ConfigError(f"{source}: frontend.processes: {f.processes} processes share each bind endpoint, "
                              f"which only tcp:// endpoints of a fixed port allow; {other!r} is not one (bind tcp://HOST:PORT, or "
                              "set frontend.processes: 1)")
        if config.viewer.port and config.viewer.public_url:
            raise ConfigError(f"{source}: viewer.public_url: one address for the viewers of {f.processes} processes, "
                              "each of which serves its own sessions' viewers on viewer.port + i: leave public_url unset "
                              "(or set frontend.processes: 1)")


def _without_retired(data: dict, source: str) -> dict:
    """`data` without the RETIRED keys it sets, each one logged with why it is ignored."""
    for (section, key), why in RETIRED.items():
        values = data.get(section)
        if isinstance(values, dict) and key in values:
            log.warning("%s: %s.%s is retired and ignored (%s): remove it", source, section, key, why)
            data = {**data, section: {k: v for k, v in values.items() if k != key}}
    return data


def _check_bridge_keys(config: Config, source: str) -> None:
    """The bridge carries every model's inputs and outputs: keys are required unless plaintext is
    asked for by name (it used to fall back to plaintext silently when a key was left out)."""
    b = config.bridge
    for i, h in enumerate(b.hosts):
        if (h.endpoint is None) == (h.dns is None):
            raise ConfigError(f"{source}: bridge.hosts.{i}: give either endpoint (one GPU host) or dns (every "
                              "address behind a name), not both or neither")
    if b.insecure_plaintext:
        return
    fix = "(`python -m supervisor keys DIR NAME` writes a pair), or set bridge.insecure_plaintext: true"
    if b.hosts and not b.client_secret_key:
        raise ConfigError(f"{source}: bridge.client_secret_key: required when bridge.hosts is set {fix}")
    missing = next((i for i, h in enumerate(b.hosts) if not h.server_key), None)
    if missing is not None:
        raise ConfigError(f"{source}: bridge.hosts.{missing}.server_key: required (the GPU host's public key) {fix}")


def load_config(path: str | Path | None = None) -> Config:
    """Load `path` (None: the embedded default) and validate it."""
    if path is None:
        return parse_config({}, "<default>", str(Path.cwd()))
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file: {err.strerror}") from None
    import yaml   # NOTE: here: a process that only resolves paths (the frontend) need not load it (8 ms)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse_config(data, str(path), str(path.resolve().parent))


def resolve_path(config: Config, path: str) -> Path:
    """Paths in a config file are relative to that file; `~` expands."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(config.base_dir) / p
