"""Shared fixtures. Ray-based tests start their own Ray instance per module and
shut it down at the end."""

from __future__ import annotations

import os

# For the tests that call ray.init themselves: their Ray instances bind every
# listener to the loopback interface, as asyncflow's own (asyncflow.runtime._ray_start.
# init_ray) do whatever the environment (tests/asyncflow/test_loopback.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Imported before any test runs, not lazily by its pytest plugin at the end of the
# session: CPython 3.11.7's parser can fail late in a session whose Ray workers
# were killed ("AST constructor recursion depth mismatch").
import hypothesis  # noqa: F401
import pytest
import ray.cloudpickle
import torch

import fake_device
import support

# The fake accelerator of the device-discipline tests is registered before any test
# runs: torch's autograd engine sizes its per-device queues at the process's first
# backward pass and never again, so a device registered later cannot run one.
# Not where CUDA is: there the real device catches device mixing, and a second
# accelerator breaks CUDA's (autograd's stream assertion, libraries that ask
# torch.accelerator for "the" device get the fake one).
if torch.cuda.is_available():
    fake_device.UNAVAILABLE = "a CUDA device is present (the fake one is for CPU-only machines)"
else:
    try:
        fake_device.install()
    except (ImportError, AttributeError) as e:  # a torch without Python device backends
        fake_device.UNAVAILABLE = f"this torch cannot register a Python device backend: {e}"

# Workers cannot import the tests tree: ship the test roles by value.
ray.cloudpickle.register_pickle_by_value(support)

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def loop_thread():
    lt = support.LoopThread()
    yield lt
    lt.close()
