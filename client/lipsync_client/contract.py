"""The numbers the wire carries, defined once for both sides: the PCM rate, the tensors' shapes, what a
model id may be. The server's config.audio and config.geometry take them from here (docs/protocol.md)."""

from __future__ import annotations

SAMPLE_RATE = 16000                    # Hz: the PCM of `composite` and of the demo utterance
VISUAL_SHAPE = (6, 320, 320)           # one frame's visual input: unmasked, then masked face crop, CHW
MOUTH_SHAPE = (3, 320, 320)            # one frame's mouth output: BGR in [0, 1], CHW

# Model ids become directory names and shm/metric labels: no path tricks. `\Z`, not `$`: `$` also
# matches before a trailing newline (msgspec, like `re.search`, applies the pattern as written).
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z"
