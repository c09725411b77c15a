"""The batch sizes an inference worker runs onnxruntime at, built once, and how a batch of any size maps
onto them.

On a GPU every new input shape costs a first call of seconds (cuDNN builds its execution plans per
shape; docs/benchmarks.md), so a worker runs only at prepared sizes, each warmed before any request
depends on it: powers of two up to `limits.max_batch`, and `max_batch` itself. A batch is padded up to
the next prepared size (padded rows are zeros whose outputs are dropped), which is never more than 2x
for powers of two; a batch larger than the largest size runs as full chunks of it and one padded rest.
On the CPU provider a worker runs one frame per call (gpu_actor/own_session.py says why): one size, 1.
A model with a fixed batch dimension has that one size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional


def prepared_sizes(max_batch: int, batched: bool = True, fixed: Optional[int] = None) -> tuple[int, ...]:
    """The sizes a worker prepares: `fixed` for a fixed-batch model; 1 where calls are one frame each
    (`batched` False: the CPU provider); else powers of two below `max_batch`, and `max_batch`."""
    if fixed:
        return (fixed,)
    if not batched or max_batch <= 1:
        return (1,)
    sizes = [1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch]
    return (*sizes, max_batch)


@dataclass(frozen=True)
class Step:
    """Rows [start, end) of a batch, run in one call at `size` (>= end - start; the rest are padding)."""

    start: int
    end: int
    size: int

    @property
    def padding(self) -> int:
        return self.size - (self.end - self.start)


class BatchShapes:
    """A worker's prepared sizes, ascending; `plan(n)` splits a batch of n into calls at those sizes."""

    def __init__(self, sizes: tuple[int, ...]):
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"prepared batch sizes must be positive, got {sizes}")
        self.sizes = tuple(sorted(set(sizes)))

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def pad_to(self, n: int) -> int:
        """The smallest prepared size that holds n frames (n <= largest)."""
        if not 1 <= n <= self.largest:
            raise ValueError(f"a call holds 1 to {self.largest} frames, got {n}")
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def plan(self, n: int) -> list[Step]:
        """Calls for a batch of n frames: full calls at the largest size, then the rest padded up."""
        steps, start = [], 0
        while n - start > self.largest:
            steps.append(Step(start, start + self.largest, self.largest))
            start += self.largest
        if n > start:
            steps.append(Step(start, n, self.pad_to(n - start)))
        return steps
