"""MegatronTrainingEngine: HF <-> Megatron weight mapping on CPU, the engine on GPU.

The mapping and tensor-parallel split functions are plain tensor code and run
everywhere. The engine itself needs megatron-core and CUDA (Megatron's RoPE and RNG
tracker are CUDA-only): those tests are marked ``gpu`` and compare it with the
PyTorch-native TrainingEngine on the same model and batch.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
import torch
from engines_testlib import make_batch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from workers.engines import EngineConfigError, TrainingConfig, TrainingEngine, ValueHead
from workers.engines._megatron import (
    GPTShape,
    MegatronConfig,
    MegatronTrainingEngine,
    hf_to_megatron,
    megatron_available,
    megatron_shard_to_hf,
    megatron_tensor_to_hf,
    megatron_to_hf,
    merge_from_tp,
    split_for_tp,
)
from workers.models import ValueModel
from workers.objectives import PolicyLoss, ValueLoss

HAVE_MEGATRON = megatron_available() is None
VOCAB = 40
# The comparisons with the native engine are float32 on both sides ("auto" is bf16 on a GPU).
FP32 = {"precision": "fp32"}


def _config(arch: str, *, tied: bool = False) -> LlamaConfig | Qwen2Config:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    if arch == "qwen2":
        return Qwen2Config(**kw, use_sliding_window=False)
    return LlamaConfig(**kw)


def _model(arch: str, *, tied: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = _config(arch, tied=tied)
    model = Qwen2ForCausalLM(config) if arch == "qwen2" else LlamaForCausalLM(config)
    with torch.no_grad():  # random biases, so that a misplaced one shows
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return model


# ------------------------------------------------------------- mapping (CPU)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_hf_megatron_mapping_roundtrips(arch: str, tied: bool) -> None:
    model = _model(arch, tied=tied)
    shape = GPTShape.from_hf_config(model.config)
    hf = model.state_dict()
    mg = hf_to_megatron(hf, shape)
    back = megatron_to_hf(mg, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # Megatron's shapes: fused q/k/v per query group, fused gate/up.
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    assert mg["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (qkv, 64)
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in mg) == (arch == "qwen2")
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96, 64)
    assert ("output_layer.weight" in mg) == (not tied)


def test_fused_qkv_keeps_each_query_group_with_its_key_and_value() -> None:
    model = _model("llama")
    shape = GPTShape.from_hf_config(model.config)
    attn = model.model.layers[0].self_attn
    qkv = hf_to_megatron(model.state_dict(), shape)[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    d, per_group = shape.head_dim, shape.num_heads // shape.num_kv_heads
    block = (per_group + 2) * d
    for group in range(shape.num_kv_heads):
        rows = qkv[group * block : (group + 1) * block]
        q_rows = attn.q_proj.weight[group * per_group * d : (group + 1) * per_group * d]
        assert torch.equal(rows[: per_group * d], q_rows)
        assert torch.equal(
            rows[per_group * d : per_group * d + d], attn.k_proj.weight[group * d : (group + 1) * d]
        )
        assert torch.equal(
            rows[per_group * d + d :], attn.v_proj.weight[group * d : (group + 1) * d]
        )


def test_value_model_mapping_roundtrips() -> None:
    value = ValueModel.from_causal_lm(_model("llama"), seed=1)
    shape = GPTShape.from_hf_config(value.config)
    hf = value.state_dict()
    mg = hf_to_megatron(hf, shape, kind="value")
    assert mg["output_layer.weight"].shape == (1, 64)
    assert torch.equal(mg["output_layer.bias"], hf["head.bias"])
    back = megatron_to_hf(mg, shape, kind="value")
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_tensor_parallel_split_then_merge_is_the_identity(arch: str, tied: bool, tp: int) -> None:
    model = _model(arch, tied=tied)
    shape = GPTShape.from_hf_config(model.config)
    mg = hf_to_megatron(model.state_dict(), shape)
    for name, full in mg.items():
        shards = split_for_tp(name, full, tp_size=tp, vocab_size=VOCAB)
        assert len(shards) == tp
        assert len({tuple(s.shape) for s in shards}) == 1, name
        merged = merge_from_tp(name, shards, vocab_size=VOCAB)
        assert torch.equal(merged, full), name


def test_tensor_parallel_shards_follow_megatrons_layout() -> None:
    model = _model("llama")
    shape = GPTShape.from_hf_config(model.config)
    mg = hf_to_megatron(model.state_dict(), shape)
    tp = 2
    # Vocabulary: padded to 128 * tp rows, zeros beyond the real ones.
    emb = split_for_tp(
        "embedding.word_embeddings.weight",
        mg["embedding.word_embeddings.weight"],
        tp_size=tp,
        vocab_size=VOCAB,
    )
    assert [s.shape[0] for s in emb] == [shape.padded_vocab_size(tp) // tp] * tp == [128, 128]
    assert torch.equal(emb[0][:VOCAB], mg["embedding.word_embeddings.weight"])
    assert not emb[0][VOCAB:].any() and not emb[1].any()
    # fc1: each rank holds its slice of gate, then its slice of up.
    gate = model.model.layers[0].mlp.gate_proj.weight
    up = model.model.layers[0].mlp.up_proj.weight
    fc1 = split_for_tp(
        "decoder.layers.0.mlp.linear_fc1.weight",
        mg["decoder.layers.0.mlp.linear_fc1.weight"],
        tp_size=tp,
        vocab_size=VOCAB,
    )
    assert torch.equal(fc1[1], torch.cat([gate[48:], up[48:]]))
    # Row-parallel: columns split; replicated: same tensor everywhere.
    proj = split_for_tp(
        "decoder.layers.0.self_attention.linear_proj.weight",
        mg["decoder.layers.0.self_attention.linear_proj.weight"],
        tp_size=tp,
        vocab_size=VOCAB,
    )
    assert proj[0].shape == (64, 32)
    norm = split_for_tp(
        "decoder.final_layernorm.weight",
        mg["decoder.final_layernorm.weight"],
        tp_size=tp,
        vocab_size=VOCAB,
    )
    assert all(torch.equal(n, mg["decoder.final_layernorm.weight"]) for n in norm)


def test_tied_embedding_also_yields_the_lm_head() -> None:
    model = _model("qwen2", tied=True)
    shape = GPTShape.from_hf_config(model.config)
    emb = model.model.embed_tokens.weight
    names = [n for n, _ in megatron_tensor_to_hf("embedding.word_embeddings.weight", emb, shape)]
    assert names == ["model.embed_tokens.weight", "lm_head.weight"]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_a_tensor_parallel_shard_maps_to_the_native_engines_shards(arch: str, tied: bool, tp: int) -> None:
    """Rank j's shard of a split Megatron tensor gives part j of q/k/v/gate/up along
    dim 0 and of o/down along dim 1: what DTensor tensor parallelism gives rank j."""
    model = _model(arch, tied=tied)
    shape = GPTShape.from_hf_config(model.config)
    hf = model.state_dict()
    seen = set()
    for name, full in hf_to_megatron(hf, shape).items():
        if ".linear_" not in name:
            with pytest.raises(EngineConfigError, match="gather it"):
                megatron_shard_to_hf(name, full, shape, tp_size=tp)
            continue
        for rank, shard in enumerate(split_for_tp(name, full, tp_size=tp, vocab_size=VOCAB)):
            for hf_name, part in megatron_shard_to_hf(name, shard, shape, tp_size=tp):
                dim = 1 if hf_name.endswith(("o_proj.weight", "down_proj.weight")) else 0
                assert torch.equal(part, hf[hf_name].chunk(tp, dim)[rank]), (hf_name, rank)
                seen.add(hf_name)
    assert seen == {n for n in hf if ".layers." in n and "layernorm" not in n}


def test_config_validation() -> None:
    with pytest.raises(EngineConfigError, match=r"MegatronConfig\.seed must be an int"):
        MegatronConfig(seed="0")  # type: ignore[arg-type]
    bad = _config("llama")
    bad.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0}
    with pytest.raises(EngineConfigError, match="default RoPE"):
        GPTShape.from_hf_config(bad)


@pytest.mark.parametrize(("installed", "problem"), [
    (None, "megatron-core is not installed: pip install 'megatron-core>=0.16'"),
    ("0.13.1", "megatron-core 0.13.1 is installed, the engine needs >= 0.16"),
    ("0.16.1", None),
    ("0.19.2rc1", None),
])
def test_megatron_available_reads_the_installed_version(
    monkeypatch: pytest.MonkeyPatch, installed: str | None, problem: str | None
) -> None:
    def version(name: str) -> str:
        assert name == "megatron-core"
        if installed is None:
            raise metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(metadata, "version", version)
    found = megatron_available()
    assert found == problem if problem is None else found is not None and found.startswith(problem)


@pytest.mark.skipif(HAVE_MEGATRON, reason="checks the message shown without megatron-core")
def test_engine_without_megatron_says_how_to_install_it() -> None:
    with pytest.raises(EngineConfigError, match=re.escape("pip install 'megatron-core>=0.16'")):
        MegatronTrainingEngine(_model("llama"), config=TrainingConfig())


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core")
def test_engine_refuses_a_model_off_cuda_and_sharded_data_parallelism() -> None:
    with pytest.raises(EngineConfigError, match="needs the model on a CUDA device"):
        MegatronTrainingEngine(_model("llama"), config=TrainingConfig())
    with pytest.raises(EngineConfigError, match="data_parallel"):
        MegatronTrainingEngine(_model("llama"), config=TrainingConfig(data_parallel="shard"))
    with pytest.raises(EngineConfigError, match="activation_checkpointing=False"):
        MegatronTrainingEngine(_model("llama"), config=TrainingConfig(activation_checkpointing=True))


# --------------------------------------------------------------- engine (GPU)

gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_MEGATRON), reason="needs CUDA and megatron-core"
)


@pytest.fixture
def nccl_world(tmp_path: Path) -> Iterator[None]:
    """A one-rank NCCL default group (Megatron's global parallel state stays untouched)."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("nccl_world")
@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_engine_matches_the_native_training_engine(arch: str, tied: bool, tmp_path: Path) -> None:
    model = _model(arch, tied=tied).cuda()
    config = TrainingConfig(lr=1e-3, micro_batch_size=3, **FP32)
    native = TrainingEngine(copy.deepcopy(model), config=config, loss=PolicyLoss())
    engine = MegatronTrainingEngine(copy.deepcopy(model), config=config, loss=PolicyLoss())
    batch = make_batch(rows=6)  # token ids < engines_testlib.VOCAB = 32 <= VOCAB
    for mine, ref in zip(engine.log_probs(batch), native.log_probs(batch), strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)
    mine_metrics, ref_metrics = engine.train_step(batch), native.train_step(batch)
    assert mine_metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
    assert mine_metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
    ref_weights = dict(native.named_full_weights())
    weights = {n: t.clone() for n, t in engine.named_full_weights()}
    assert weights.keys() == ref_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref_weights[name], atol=1e-4, rtol=0)

    engine.save(tmp_path / "ckpt")
    after_save = engine.train_step(batch)
    engine.load(tmp_path / "ckpt")
    replayed = engine.train_step(batch)  # CUDA backward is not bitwise deterministic
    assert replayed["loss"] == pytest.approx(after_save["loss"], rel=1e-5)
    assert replayed["grad_norm"] == pytest.approx(after_save["grad_norm"], rel=1e-4)
    assert engine.step == 2
    engine.export_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("nccl_world")
def test_value_engine_matches_the_native_training_engine() -> None:
    value = ValueModel.from_causal_lm(_model("llama"), seed=1).cuda()
    config = TrainingConfig(lr=1e-3, **FP32)
    native = TrainingEngine(copy.deepcopy(value), config=config, head=ValueHead(), loss=ValueLoss())
    engine = MegatronTrainingEngine(copy.deepcopy(value), config=config, loss=ValueLoss())
    batch = make_batch(rows=6)  # token ids < engines_testlib.VOCAB = 32 <= VOCAB
    torch.testing.assert_close(engine.values(batch), native.values(batch), atol=1e-4, rtol=0)
    mine, ref = engine.train_step(batch), native.train_step(batch)
    assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("nccl_world")
def test_bf16_engine_trains_float32_weights_close_to_the_native_one() -> None:
    """precision="bf16": Megatron's layers under bfloat16 autocast, float32 master weights."""
    model = _model("llama").cuda()
    config = TrainingConfig(lr=1e-3, precision="bf16")
    native = TrainingEngine(copy.deepcopy(model), config=config, loss=PolicyLoss())
    engine = MegatronTrainingEngine(copy.deepcopy(model), config=config, loss=PolicyLoss())
    assert engine.precision == "bf16"
    batch = make_batch(rows=6)
    for mine, ref in zip(engine.log_probs(batch), native.log_probs(batch), strict=True):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, ref, atol=5e-2, rtol=0)
    mine_metrics, ref_metrics = engine.train_step(batch), native.train_step(batch)
    assert mine_metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-2)
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


def _tp2_rank(rank: int, out: Path) -> None:
    """One rank of a 2-GPU run: TP=2 must give the one-GPU native engine's results."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank)
    model = _model("llama").cuda()
    config = TrainingConfig(lr=1e-3, **FP32)
    native = TrainingEngine(copy.deepcopy(model), config=config, loss=PolicyLoss())
    mesh = init_device_mesh("cuda", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    engine = MegatronTrainingEngine(copy.deepcopy(model), config=config, mesh=mesh, loss=PolicyLoss())
    batch = make_batch(rows=6)  # token ids < engines_testlib.VOCAB = 32 <= VOCAB
    torch.testing.assert_close(
        engine.log_probs(batch)[0], native.log_probs(batch)[0], atol=1e-4, rtol=0
    )
    assert engine.train_step(batch)["grad_norm"] == pytest.approx(
        native.train_step(batch)["grad_norm"], rel=1e-4
    )
    (out / f"ok{rank}").touch()


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAVE_MEGATRON and torch.cuda.device_count() >= 2), reason="needs 2 GPUs and megatron-core"
)
def test_tensor_parallel_engine_matches_one_gpu(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(
        _tp2_worker, args=(str(tmp_path), str(out)), nprocs=2, start_method="spawn", join=True
    )
    assert sorted(p.name for p in out.iterdir()) == ["ok0", "ok1"]


def _tp2_worker(rank: int, tmp: str, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        _tp2_rank(rank, Path(out))
    finally:
        dist.destroy_process_group()
