"""Routing of the engines' loggers: below the terminal's level to the file only,
harmless warnings never on the terminal, each message once, and ``remove`` gives
each logger its own set-up back."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from workers import EngineLogs, engine_log_env


def test_records_below_the_terminal_level_go_to_the_file_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = io.StringIO()
    monkeypatch.setattr("sys.stderr", terminal)
    vllm = logging.getLogger("vllm")
    own = logging.NullHandler()
    vllm.addHandler(own)
    handlers, propagate = list(vllm.handlers), vllm.propagate  # vLLM's own set-up, if it was imported
    log = tmp_path / "engines.log"
    with EngineLogs(log_file=log):
        logging.getLogger("vllm.engine").info("kv cache ready")
        logging.getLogger("ray.worker").info("worker started")
        for _ in range(3):  # one reload a step
            logging.getLogger("vllm.reload").warning("RotaryEmbedding: Failed to load weights")
            logging.getLogger("vllm.engine").warning("the cache is small")
        assert own not in vllm.handlers
    shown = terminal.getvalue()
    assert shown == "WARNING vllm.engine: the cache is small\n"
    kept = log.read_text()
    assert "INFO vllm.engine: kv cache ready" in kept and "INFO ray.worker: worker started" in kept
    assert kept.count("RotaryEmbedding: Failed to load weights") == 3 and kept.count("the cache is small") == 3
    assert vllm.handlers == handlers and vllm.propagate is propagate  # given back as it was
    vllm.removeHandler(own)


def test_verbose_shows_info_and_the_worker_environment_says_so(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = io.StringIO()
    monkeypatch.setattr("sys.stderr", terminal)
    with EngineLogs(terminal_level=logging.INFO, log_file=None):
        logging.getLogger("transformers.modeling_utils").info("loading weights")
        logging.getLogger("transformers.modeling_utils").debug("not shown")
    assert terminal.getvalue() == "INFO transformers.modeling_utils: loading weights\n"
    env = engine_log_env(terminal_level=logging.INFO, log_file=tmp_path / "engines.log")
    assert env["ASYNCFLOW_LOG"] == "info" and env["ASYNCFLOW_ENGINE_LOG"] == str(tmp_path / "engines.log")
    assert env["VLLM_CONFIGURE_LOGGING"] == "0" and env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
