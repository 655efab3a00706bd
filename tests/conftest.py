"""Shared fixtures. Ray-based tests start their own Ray instance per module and
shut it down at the end."""

from __future__ import annotations

import os

import pytest
import ray.cloudpickle

import support

# Workers cannot import the tests tree: ship the test roles by value.
ray.cloudpickle.register_pickle_by_value(support)

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def loop_thread():
    lt = support.LoopThread()
    yield lt
    lt.close()
