"""Request validation before any work: header schema, op, model id, batch range, frame count and byte
sizes, format and quality. Every failure is one `RequestError` with the code and what to change."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from frontend.protocol import MODEL_OPS, TENSOR_OPS, VISUAL_SHAPE, ErrorCode, Op, RequestHeader, RequestId

VISUAL_BYTES = 4 * VISUAL_SHAPE[0] * VISUAL_SHAPE[1] * VISUAL_SHAPE[2]


class RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str, request_id: RequestId = None):
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


def _bad(message: str, request_id: RequestId = None) -> RequestError:
    return RequestError(ErrorCode.BAD_REQUEST, message, request_id)


def _schema_message(err: msgspec.ValidationError) -> str:
    text = str(err)
    match = re.search(r" - at `\$\.?([^`]*)`$", text)
    where = f"header.{match.group(1)}" if match else "header"
    body = text[: match.start()] if match else text
    unknown = re.match(r"Object contains unknown field `(.+)`", body)
    if unknown:
        return (f"header.{unknown.group(1)}: unknown key; allowed keys are op, id, model, batch, start_frame, "
                "format, quality, timeout_ms")
    if body.startswith("Invalid enum value") and where == "header.op":
        return f"header.op: unknown op; expected one of {', '.join(o.value for o in Op)}"
    if body.startswith("Object missing required field"):
        return "header.op: required key is missing"
    return f"{where}: {body[0].lower()}{body[1:]}"


def parse_header(raw: bytes) -> RequestHeader:
    """JSON header -> RequestHeader, or RequestError(bad_request) that still echoes a readable id."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise _bad(f"header: not valid UTF-8 JSON ({err}); send a JSON object such as {{\"op\": \"health\"}}") from None
    if not isinstance(data, dict):
        raise _bad("header: expected a JSON object such as {\"op\": \"health\"}")
    request_id = data.get("id") if isinstance(data.get("id"), (str, int)) and not isinstance(data.get("id"), bool) else None
    try:
        return msgspec.convert(data, RequestHeader, strict=True)
    except msgspec.ValidationError as err:
        raise _bad(_schema_message(err), request_id) from None


@dataclass(frozen=True)
class Tensors:
    visual: Optional[memoryview]       # None: audio-only composite
    audio: memoryview
    audio_per_frame: bool              # [batch, *A] (True) or one window [*A] for every frame


def check_request(header: RequestHeader, payload: list, max_batch: int) -> None:
    """Everything that does not need the model: required keys, batch range, payload count."""
    rid = header.id
    if header.op in MODEL_OPS and header.model is None:
        raise _bad(f"header.model: required for op {header.op.value}", rid)
    if header.op in TENSOR_OPS:
        if header.batch is None:
            raise _bad(f"header.batch: required for op {header.op.value} (1..{max_batch})", rid)
        if header.batch > max_batch:
            raise _bad(f"header.batch: {header.batch} is more than limits.max_batch ({max_batch}); "
                       "split the request", rid)
        allowed = (2,) if header.op is Op.INFER else (1, 2)
        if len(payload) not in allowed:
            want = "2 (visual, audio)" if header.op is Op.INFER else "1 (audio) or 2 (visual, audio)"
            raise _bad(f"payload: {len(payload)} frames after the header; op {header.op.value} takes {want}", rid)
    elif payload:
        raise _bad(f"payload: op {header.op.value} takes no frames after the header, got {len(payload)}", rid)
    if header.quality is not None and header.format not in (None, "jpeg"):
        raise _bad("header.quality: only applies to format jpeg", rid)


def check_tensors(header: RequestHeader, payload: list, audio_shape: tuple[int, ...]) -> Tensors:
    """Byte sizes against the model's shapes."""
    rid, batch = header.id, header.batch
    visual = payload[0] if len(payload) == 2 else None
    audio = payload[-1]
    if visual is not None and len(visual) != batch * VISUAL_BYTES:
        raise _bad(f"payload[0] (visual): {len(visual)} bytes; expected float32 [{batch}, 6, 320, 320] = "
                   f"{batch * VISUAL_BYTES} bytes", rid)
    window = 4 * int(_prod(audio_shape))
    shape = ", ".join(map(str, audio_shape))
    if len(audio) == batch * window:
        per_frame = True
    elif len(audio) == window:
        per_frame = False
    else:
        raise _bad(f"payload[{len(payload) - 1}] (audio): {len(audio)} bytes; model {header.model} expects float32 "
                   f"[{batch}, {shape}] = {batch * window} bytes, or one window [{shape}] = {window} bytes", rid)
    return Tensors(memoryview(visual) if visual is not None else None, memoryview(audio), per_frame)


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out
