"""What a worker sets in its own environment when it starts (workers.host._environment)."""

from __future__ import annotations

import os
import sys

import pytest

from workers import LIVE_ENV, STARTUP_ENV, split_env
from workers.host._engine_logs import LEVEL_ENV, LOG_FILE_ENV
from workers.host._environment import set_env


def test_split_env_keeps_for_ray_only_what_the_worker_cannot_set_in_time() -> None:
    own, ray_sets = split_env({LEVEL_ENV: "info", "PYTHONPATH": "/x", "OMP_NUM_THREADS": "1"})
    assert own == {LEVEL_ENV: "info", "PYTHONPATH": "/x"} and ray_sets == {"OMP_NUM_THREADS": "1"}
    assert LIVE_ENV <= STARTUP_ENV and LOG_FILE_ENV in LIVE_ENV


def test_set_env_expands_as_ray_does_and_puts_pythonpath_first_on_sys_path(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(sys, "path", ["/script", "/lib"])
    monkeypatch.setenv("PYTHONPATH", "/lib")
    monkeypatch.delenv("ASYNCFLOW_NOT_SET_ANYWHERE", raising=False)
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    set_env({"PYTHONPATH": f"{tmp_path}{os.pathsep}${{PYTHONPATH}}",
             LEVEL_ENV: "debug${ASYNCFLOW_NOT_SET_ANYWHERE}"})
    assert os.environ["PYTHONPATH"] == f"{tmp_path}{os.pathsep}/lib"
    assert os.environ[LEVEL_ENV] == "debug", "an unset ${NAME} stands for nothing"
    assert sys.path == ["/script", str(tmp_path), "/lib"], "new directories after the script's, none twice"


def test_set_env_refuses_a_variable_only_ray_can_set_in_time(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        set_env({"OMP_NUM_THREADS": "1"})
    assert "OMP_NUM_THREADS" not in os.environ
