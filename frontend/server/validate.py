"""Request validation before any work: header schema, op, model id, batch range, frame count and byte
sizes, format and quality. Every failure is one `RequestError` with the code and what to change."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from config.audio import AUDIO_SHAPE, frame_count
from config.geometry import VISUAL_BYTES, VISUAL_SHAPE
from frontend.core.request import RequestError
from lipsync_client.protocol import MODEL_OPS, SESSION_OPS, TENSOR_OPS, ErrorCode, Op, RequestHeader, RequestId

MAX_FRAMES = 3          # header + visual + audio, the most any op takes


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
                "format, quality, timeout_ms, audio_format, return_audio, session, fps, audio, last, utterance, "
                "webrtc, sample_rate, pixel_format")
    if body.startswith("Invalid enum value") and where == "header.op":
        return f"header.op: unknown op; expected one of {', '.join(o.value for o in Op)}"
    if body.startswith("Object missing required field"):
        return "header.op: required key is missing"
    return f"{where}: {body[0].lower()}{body[1:]}"


def check_message(sizes: list[int], max_header_bytes: int, max_message_bytes: int) -> None:
    """Bounds on the whole message (frame byte sizes after the envelope), checked before any parsing.
    libzmq's ZMQ_MAXMSGSIZE bounds each frame only, not their number or their sum."""
    if len(sizes) > MAX_FRAMES:
        raise _bad(f"message: {len(sizes)} frames; a request is a header and at most {MAX_FRAMES - 1} payload frames")
    if sizes and sizes[0] > max_header_bytes:
        raise _bad(f"header: {sizes[0]} bytes, more than limits.max_header_bytes ({max_header_bytes})")
    total = sum(sizes)
    if total > max_message_bytes:
        raise _bad(f"message: {total} bytes in all, more than limits.max_message_bytes ({max_message_bytes}); "
                   "split the request")


_HEADER = msgspec.json.Decoder(RequestHeader, strict=True)


def parse_header(raw: bytes) -> RequestHeader:
    """JSON header -> RequestHeader, or RequestError(bad_request) that still echoes a readable id."""
    # NOTE: a valid header (every live frame's audio has one) is decoded in one step, 20x faster than
    # json + convert; anything else takes the path below, which says what is wrong
    try:
        header = _HEADER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    else:
        if not isinstance(header.id, str) or _encodable(header.id):
            return header
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _bad("header: JSON nested too deeply; send a flat JSON object such as {\"op\": \"health\"}") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise _bad(f"header: not valid UTF-8 JSON ({err}); send a JSON object such as {{\"op\": \"health\"}}") from None
    if not isinstance(data, dict):
        raise _bad("header: expected a JSON object such as {\"op\": \"health\"}")
    request_id = data.get("id")
    if isinstance(request_id, str) and not _encodable(request_id):
        # NOTE: JSON can spell a lone surrogate ("\ud800") that UTF-8 cannot carry back: a reply that
        # echoed it could not be sent at all.
        raise _bad("header.id: not valid Unicode (a lone surrogate); use a plain string or an integer")
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        request_id = None
    try:
        return msgspec.convert(data, RequestHeader, strict=True)
    except msgspec.ValidationError as err:
        raise _bad(_schema_message(err), request_id) from None
    except RecursionError:
        raise _bad("header: a value is nested too deeply", request_id) from None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Tensors:
    visual: Optional[memoryview]       # None: audio-only composite
    audio: memoryview
    audio_per_frame: bool              # [batch, *A] (True) or one window [*A] for every frame
    batch: int = 0                     # frames (for pcm16: what the utterance yields)
    pcm: bool = False                  # audio is 16 kHz int16 PCM: the worker derives each frame's window


def check_request(header: RequestHeader, payload: list, max_batch: int) -> None:
    """Everything that does not need the model: required keys, batch range, payload count."""
    rid = header.id
    if header.op in MODEL_OPS and header.model is None:
        raise _bad(f"header.model: required for op {header.op.value}", rid)
    if header.op in TENSOR_OPS:
        if header.batch is None and header.audio_format != "pcm16":
            raise _bad(f"header.batch: required for op {header.op.value} (1..{max_batch})", rid)
        if header.batch is not None and header.batch > max_batch:
            raise _bad(f"header.batch: {header.batch} is more than limits.max_batch ({max_batch}); "
                       "split the request", rid)
        allowed = (2,) if header.op is Op.INFER else (1, 2)
        if len(payload) not in allowed:
            want = "2 (visual, audio)" if header.op is Op.INFER else "1 (audio) or 2 (visual, audio)"
            raise _bad(f"payload: {len(payload)} frames after the header; op {header.op.value} takes {want}", rid)
    elif header.op in SESSION_OPS and header.session is None:
        raise _bad(f"header.session: required for op {header.op.value} (the `session` that session_open returned)",
                   rid)
    elif header.op is Op.SESSION_AUDIO:
        if len(payload) != 1:
            raise _bad(f"payload: {len(payload)} frames after the header; op session_audio takes 1 (audio)", rid)
    elif payload:
        raise _bad(f"payload: op {header.op.value} takes no frames after the header, got {len(payload)}", rid)
    if header.return_audio and header.audio_format != "pcm16":
        raise _bad("header.return_audio: only with audio_format pcm16 (the audio returned is the PCM sent)", rid)
    if header.quality is not None and header.format not in (None, "jpeg"):
        raise _bad("header.quality: only applies to format jpeg", rid)
    if header.format == "h264" and header.op is not Op.SESSION_OPEN:
        raise _bad("header.format: h264 is for live sessions (session_open); single frames are jpeg, png or raw", rid)
    if header.webrtc and (header.op is not Op.SESSION_OPEN or header.format != "h264"):
        raise _bad("header.webrtc: only with op session_open and format h264 (the viewer sends the H.264 stream)", rid)
    if header.sample_rate is not None and (header.op is not Op.SESSION_OPEN or header.audio != "pcm16"):
        raise _bad("header.sample_rate: only with op session_open and audio pcm16 (the PCM's rate)", rid)
    if header.utterance is not None and header.op not in (Op.SESSION_AUDIO, Op.SESSION_INTERRUPT):
        raise _bad("header.utterance: only with op session_audio (the utterance a chunk belongs to) or "
                   "session_interrupt (the last utterance it retires)", rid)
    if header.pixel_format is not None and (header.op is not Op.SESSION_OPEN or header.format != "raw"):
        raise _bad("header.pixel_format: only with op session_open and format raw (the raw frames' layout)", rid)


def check_pcm(header: RequestHeader, payload: list, audio_shape: tuple[int, ...], has_encoder: bool,
              max_batch: int) -> Tensors:
    """pcm16: one utterance of 16 kHz int16 PCM; the batch is the frames it yields (config/audio.py)."""
    rid, model = header.id, header.model
    if tuple(audio_shape) != AUDIO_SHAPE:
        raise _bad(f"header.audio_format: model {model} takes {list(audio_shape)} feature windows (hubert or wenet), "
                   "whose extractors are not served: send float32 windows", rid)
    if not has_encoder:
        raise _bad(f"header.audio_format: model {model} has no audio encoder for PCM: put audio_encoder.onnx in its "
                   "directory or set audio.encoder", rid)
    audio = payload[-1]
    if len(audio) % 2:
        raise _bad(f"payload[{len(payload) - 1}] (audio): {len(audio)} bytes; pcm16 is 2 bytes per sample", rid)
    samples = len(audio) // 2
    frames = frame_count(samples)
    if not frames:
        raise _bad(f"payload[{len(payload) - 1}] (audio): {samples} samples; an utterance needs at least "
                   f"{(16 - 1) * 200} (0.19 s at 16 kHz)", rid)
    if header.batch is not None and header.batch != frames:
        raise _bad(f"header.batch: {header.batch}, but {samples} samples of PCM give {frames} frames; set batch to "
                   f"{frames} or leave it out", rid)
    if frames > max_batch:
        raise _bad(f"payload[{len(payload) - 1}] (audio): {samples} samples give {frames} frames, more than "
                   f"limits.max_batch ({max_batch}); split the utterance (a live session takes any length)", rid)
    visual = payload[0] if len(payload) == 2 else None
    if visual is not None and len(visual) != frames * VISUAL_BYTES:
        raise _bad(f"payload[0] (visual): {len(visual)} bytes; expected float32 [{frames}, {_dims(VISUAL_SHAPE)}] = "
                   f"{frames * VISUAL_BYTES} bytes for the {frames} frames this PCM gives", rid)
    return Tensors(memoryview(visual) if visual is not None else None, memoryview(audio), True, frames, True)


def check_tensors(header: RequestHeader, payload: list, audio_shape: tuple[int, ...]) -> Tensors:
    """Byte sizes against the model's shapes."""
    rid, batch = header.id, header.batch
    visual = payload[0] if len(payload) == 2 else None
    audio = payload[-1]
    if visual is not None and len(visual) != batch * VISUAL_BYTES:
        raise _bad(f"payload[0] (visual): {len(visual)} bytes; expected float32 [{batch}, {_dims(VISUAL_SHAPE)}] = "
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
    return Tensors(memoryview(visual) if visual is not None else None, memoryview(audio), per_frame, batch)


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _dims(shape) -> str:
    return ", ".join(map(str, shape))
