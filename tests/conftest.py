"""Shared fixtures. Every test segment name starts with this session's prefix, and the session
ends by asserting that none of them is left in /dev/shm."""

from __future__ import annotations

import os
import re
import secrets

import pytest

from shm import list_segments, sweep_dead_runs
from shm.segment import SHM_DIR

# Short and lowercase: it becomes `shm.prefix` of the servers the tests start.
TEST_PREFIX = "t" + secrets.token_hex(3)


@pytest.fixture(scope="session", autouse=True)
def no_shm_left_behind():
    # Earlier sessions that were killed or failed half-way used other random prefixes: sweep those
    # whose creator is gone, as a supervisor does for its own prefix.
    prefixes = {p.name.split("-")[0] for p in SHM_DIR.glob("t*-*")}
    for prefix in prefixes:
        if re.fullmatch(r"t[0-9a-f]{6}[a-z]?", prefix):
            sweep_dead_runs(prefix)
    yield
    left = list_segments(TEST_PREFIX)
    assert not left, f"/dev/shm entries left behind by the test run: {left}"


@pytest.fixture
def shm_name(request):
    """A unique segment name under the test prefix."""
    return f"{TEST_PREFIX}-{os.getpid()}-0-{secrets.token_hex(4)}"
