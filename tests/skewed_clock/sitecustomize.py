"""Test-only: shift this interpreter's monotonic clock by LIPSYNC_TEST_CLOCK_SKEW_S seconds, as a host
that has been up that much longer (or shorter) would read it. Put this directory on PYTHONPATH of a
process tree (spawned children inherit it) to give the whole tree one skewed clock."""

import os
import time

_skew = float(os.environ.get("LIPSYNC_TEST_CLOCK_SKEW_S", "0"))
if _skew:
    _monotonic = time.monotonic
    time.monotonic = lambda: _monotonic() + _skew
