"""Where a run's policy starts: the ``[model]`` directory, a GGUF file's conversion,
or the SFT warm start's model. The last two are made once and kept under
``output_dir`` in directories named after a hash of what made them (see
:func:`~asyncflow.train._rundir.cache_dir`), shared by the runs with the same
settings and never overwritten by a run with others."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import msgspec

from asyncflow.train._config import RunConfig, episode_config
from asyncflow.train._rundir import cache_dir
from asyncflow.train._sft import sft_warm_start
from asyncflow.train._signals import Say
from workers.models import gguf_to_hf_dir, read_architecture

SFT_STAMP = "asyncflow_sft.json"
"""The settings an SFT warm start's directory was trained with (written last)."""


def starting_model(config: RunConfig, *, say: Say) -> str:
    """The policy's starting directory: ``[model]``'s, a GGUF file's conversion
    (``<output_dir>/model_from_gguf-<hash of the file's path>``) or the SFT warm
    start's (``<output_dir>/sft_model-<hash of its settings>``).

    Args:
        config: the run's configuration.
        say: where progress lines go (an SFT warm start takes minutes).

    Raises:
        ConfigError: the model directory or the GGUF file cannot be used.
    """
    output_dir = Path(config.output_dir)
    if config.sft is None:
        if config.model.gguf:
            target = cache_dir(output_dir, "model_from_gguf", os.fsencode(Path(config.model.gguf).resolve()))
            say(f"model: {config.model.gguf} -> {target} (dequantised; once per file)")
            return str(gguf_to_hf_dir(config.model.gguf, target, key="model.gguf"))
        read_architecture(config.model.path)
        return config.model.path
    sft, task = config.sft, config.data.arithmetic
    # The settings' bytes as when the task was SFTConfig's first field (and before
    # demonstrations, when there are none): same settings, same directory.
    fields = msgspec.structs.asdict(sft)
    if sft.demonstration_share:  # the episodes demonstrated are the environment's
        fields["env"] = config.env
    else:
        del fields["demonstration_share"], fields["demonstration_turns"]
    settings = msgspec.json.encode({"task": task, **fields})
    target = cache_dir(output_dir, "sft_model", settings)
    if (target / SFT_STAMP).exists():
        say(f"SFT warm start: reusing {target} (same settings)")
        return str(target)
    until = f", until {sft.stop_at_train_accuracy} train accuracy" if sft.stop_at_train_accuracy else ""
    limit = f" (at most {sft.max_seconds} s)" if sft.max_seconds else ""
    say(f"SFT warm start: up to {sft.steps} steps{until}{limit} ...")
    t = time.monotonic()
    # Trained beside its place and renamed into it once complete: the directory
    # exists only complete, whatever stops this run.
    tmp = target.with_name(f".tmp_{target.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        metrics = sft_warm_start(tmp, sft, task, episode_config(config))
        (tmp / SFT_STAMP).write_bytes(settings)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / SFT_STAMP).exists():  # else a run beside this one made it first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"SFT warm start done in {time.monotonic() - t:.0f} s: "
        + ", ".join(f"{k}={v:.3g}" for k, v in metrics.items()))
    return str(target)
