"""Shared by the native engine's tests: run a module's every test with both KV caches."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["dynamic", "static"])
def decode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``NativeRolloutConfig.decode`` for this test, set as the module's ``DECODE``
    (modules opt in with ``pytestmark = pytest.mark.usefixtures("decode")``)."""
    monkeypatch.setattr(request.module, "DECODE", request.param)
    return str(request.param)
