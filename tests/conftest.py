"""Shared fixtures. Every test segment name starts with this session's prefix, and the session
ends by asserting that none of them is left in /dev/shm."""

from __future__ import annotations

import os
import secrets

import pytest

from shm import list_segments

# Short and lowercase: it becomes `shm.prefix` of the servers the tests start.
TEST_PREFIX = "t" + secrets.token_hex(3)


@pytest.fixture(scope="session", autouse=True)
def no_shm_left_behind():
    yield
    left = list_segments(TEST_PREFIX)
    assert not left, f"/dev/shm entries left behind by the test run: {left}"


@pytest.fixture
def shm_name(request):
    """A unique segment name under the test prefix."""
    return f"{TEST_PREFIX}-{os.getpid()}-0-{secrets.token_hex(4)}"
