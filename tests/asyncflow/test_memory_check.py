"""The placement memory estimate and its warnings (asyncflow.train._memory): pure
arithmetic over a model's shape, checked against hand-computed figures."""

from __future__ import annotations

from pathlib import Path

from asyncflow.train import load_config
from asyncflow.train._memory import GIB, ModelShape, check_memory, estimate_pools, memory_warnings
from workers.models import TinyModelConfig, read_architecture, save_tiny_model, tiny_hf_config

GPU_EXAMPLE = "examples/gpu/arith_grpo_1.5b.toml"


def _shape(path: str, directory: Path) -> tuple[object, ModelShape]:
    config = load_config(path)
    assert config.sft is not None
    tiny_hf_config(config.sft.model).save_pretrained(directory)  # config.json only
    return config, ModelShape.of(read_architecture(directory))


def test_the_gpu_example_fits_one_80_gb_gpu_and_its_parts_add_up(tmp_path: Path) -> None:
    config, shape = _shape(GPU_EXAMPLE, tmp_path)
    assert 1.5e9 < shape.parameters < 1.6e9
    (pool,) = estimate_pools(config, shape, context=14, cuda=True)
    assert pool.pool == "gpu" and pool.ranks == 1
    # float32 master weights, gradients and AdamW moments: 16 bytes a parameter.
    assert pool.parts["actor training state"] == 16 * shape.parameters
    assert pool.parts["actor rollout weights"] == pool.parts["ref weights"] == 2 * shape.parameters  # bf16
    assert memory_warnings([pool], memory=80 * GIB) == []
    (warning,) = memory_warnings([pool], memory=24 * GIB)
    assert "pool 'gpu' may not fit" in warning and "actor training state 23.0" in warning


def test_pipeline_stages_hold_their_share_of_the_state(tmp_path: Path) -> None:
    _, shape = _shape(GPU_EXAMPLE, tmp_path)
    staged = load_config(GPU_EXAMPLE, {"pools.gpu.devices": 4, "placement.actor.p": 2, "placement.ref.p": 2})
    parts = estimate_pools(staged, shape, context=14, cuda=True)[0].parts
    # Two stages over two data-parallel ranks, sharded (1.5 B parameters): a quarter each.
    assert parts["actor training state"] == 16 * -(-shape.parameters // 2) // 2
    assert parts["ref weights"] == 2 * -(-shape.parameters // 2)  # bf16, one stage's


def test_checkpointing_offload_and_precision_move_the_estimate(tmp_path: Path) -> None:
    config, shape = _shape(GPU_EXAMPLE, tmp_path)
    on_gpu = estimate_pools(config, shape, context=256, cuda=True)[0].parts
    plain = load_config(GPU_EXAMPLE, {"actor.activation_checkpointing": False})
    assert estimate_pools(plain, shape, context=256, cuda=True)[0].parts["actor activations"] > \
        on_gpu["actor activations"]
    on_cpu = estimate_pools(config, shape, context=256, cuda=False)[0].parts  # "bf16" set: bf16 there too
    fp32 = load_config(GPU_EXAMPLE, {"actor.precision": "fp32"})
    assert estimate_pools(fp32, shape, context=256, cuda=True)[0].parts["ref weights"] == 4 * shape.parameters
    assert on_cpu["ref weights"] == 2 * shape.parameters
    # A generation whose KV cache outweighs training: offloading leaves it the memory.
    long = {"algorithm.sampling.n": 64, "train.prompts_per_step": 256}
    generating = estimate_pools(load_config(GPU_EXAMPLE, long), shape, context=256, cuda=True)[0].parts
    offloaded = estimate_pools(load_config(GPU_EXAMPLE, long | {"actor.offload_optimizer": True}), shape,
                               context=256, cuda=True)[0].parts
    assert "actor KV cache" in generating
    assert offloaded["actor training state kept"] == generating["actor training state kept"] - 8 * shape.parameters


def test_cpu_pools_share_the_host(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path, TinyModelConfig(), seed=0)
    config = load_config("examples/arith_grpo.toml", {"sft": None, "model.path": str(model),
                                                      "pools.main.devices": 2})
    assert check_memory(config, str(model), context=12) == []  # a tiny model on a 24 GiB machine
    (pool,) = estimate_pools(config, ModelShape.of(read_architecture(model)), context=12, cuda=False)
    (warning,) = memory_warnings([pool], memory=pool.total)  # two ranks: twice one rank's estimate
    assert "this machine's" in warning
