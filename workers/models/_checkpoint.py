"""Checks shared by the loaders: is a directory a checkpoint of a supported architecture."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from channels import ConfigError

__all__ = ["SUPPORTED_ARCHITECTURES", "check_supported_checkpoint"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2")
"""Values of ``model_type`` (in ``config.json``) that the loaders accept."""


def check_supported_checkpoint(path: Path) -> PretrainedConfig:
    """Read a checkpoint's config and check its architecture is supported.

    Args:
        path: A local checkpoint directory.

    Returns:
        The checkpoint's transformers config.

    Raises:
        ConfigError: If ``path`` has no ``config.json``.
        ValueError: If its ``model_type`` is not in :data:`SUPPORTED_ARCHITECTURES`.
    """
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{path} has no config.json; pass a local Hugging Face checkpoint directory "
            "(save_tiny_model writes one)"
        )
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{path} holds a {hf_config.model_type!r} model; supported architectures "
            f"(config.json model_type) are {SUPPORTED_ARCHITECTURES}"
        )
    return hf_config
