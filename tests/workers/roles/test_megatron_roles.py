"""Roles on the Megatron engine: the choice of engine, what is refused and how, and the
weights a Megatron model gives by Hugging Face names (sync into the rollout engine,
the ``weights()`` rows, the export).

On the CPU (no megatron-core needed): the roles default to the native engine, an
unknown engine or a layout Megatron cannot serve is refused with the role's name,
and the Hugging Face face of a Megatron model (:class:`HFStyleGPT`, fed Megatron
tensor-parallel shards of a real model over real gloo groups) gives the same full
weights, the same ``weights()`` rows as the native engine's tensor parallelism, and
an export that loads back. On a GPU with megatron-core: actor, reference and critic
built with ``engine="megatron"`` match the native roles and train.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from roles_testlib import TOK, local_ctx, random_rows, run_ranks
from torch import Tensor, nn

from channels import Batch, ConfigError, GenerationLayout, Layout
from workers import WorkerContext
from workers.engines import (
    CausalLMHead,
    MegatronTrainingEngine,
    TrainingConfig,
    TrainingEngine,
    megatron_available,
)
from workers.engines._megatron_model import HFStyleGPT
from workers.engines._megatron_weights import GPTShape, hf_to_megatron, split_for_tp
from workers.models import TinyModelConfig, ValueModel, load_model, save_tiny_model
from workers.roles import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ReferenceConfig,
    ReferenceWorker,
)
from workers.roles._engine_choice import build_engine
from workers.roles._weights import assemble_weights, weight_rows

HAVE_MEGATRON = megatron_available() is None
# Two query heads over two key/value heads: t = 2 splits both.
TP2 = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=32, num_hidden_layers=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("policy"), TP2, seed=0))


# ------------------------------------------------------------- choice and refusals


def test_roles_take_the_native_engine_by_default(model_dir: str) -> None:
    assert ActorConfig(model_dir=model_dir).engine == "native"
    assert CriticConfig(model_dir=model_dir).engine == "native"
    ref = ReferenceWorker(local_ctx("ref"), ReferenceConfig(model_dir=model_dir))
    assert type(ref.engine) is TrainingEngine


@pytest.mark.parametrize("config", [ActorConfig, CriticConfig, ReferenceConfig])
def test_an_unknown_engine_is_refused_naming_the_field(model_dir: str, config: Any) -> None:
    with pytest.raises(ConfigError, match=f"{config.__name__}.engine must be one of .'native', 'megatron'., "
                                          "got 'deepspeed'"):
        config(model_dir=model_dir, engine="deepspeed")


def _ctx(layout: Layout) -> WorkerContext:
    return dataclasses.replace(local_ctx("actor"), layout=layout)


@pytest.mark.parametrize(("layout", "message"), [
    (Layout(p=2), "actor (engine='megatron'): layout p2-t1-d1 has p = 2 pipeline stages"),
    (Layout(t=2, gen=GenerationLayout(tg=1)), "actor (engine='megatron'): a generation layout"),
])
def test_layouts_the_megatron_engine_cannot_serve_are_refused_before_anything_runs(
        model_dir: str, layout: Layout, message: str) -> None:
    model = load_model(model_dir)
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        build_engine(_ctx(layout), model, engine="megatron", config=TrainingConfig(), head=CausalLMHead())
    assert "set engine='native'" in str(caught.value)


@pytest.mark.skipif(HAVE_MEGATRON, reason="checks the message shown without megatron-core")
def test_megatron_without_megatron_core_is_refused_with_one_clear_line(model_dir: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ReferenceWorker(local_ctx("ref"), ReferenceConfig(model_dir=model_dir, engine="megatron"))
    assert str(caught.value) == ("ref (engine='megatron'): megatron-core is not installed: pip install "
                                 "'megatron-core>=0.16' (asyncflow's 'gpu' extra); or set engine='native'")


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core")
def test_megatron_off_cuda_is_refused(model_dir: str) -> None:
    with pytest.raises(ConfigError, match="needs the model on a CUDA device"):
        ReferenceWorker(local_ctx("ref"), ReferenceConfig(model_dir=model_dir, engine="megatron"))


# ------------------------------------------- the Hugging Face face of a Megatron model


class _Shards(nn.Module):
    """Stands in for a ``GPTModel``: its state dict is given Megatron tensors."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.tensors = dict(tensors)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return dict(self.tensors)


def _megatron_face(model: nn.Module, *, kind: str, group: dist.ProcessGroup) -> HFStyleGPT:
    """``model`` as the Megatron engine holds it on this rank of ``group`` (TP)."""
    shape = GPTShape.from_hf_config(model.config)
    tp, rank = group.size(), group.rank()
    shards = {name: split_for_tp(name, full, tp_size=tp, vocab_size=shape.vocab_size, kind=kind)[rank]
              for name, full in hf_to_megatron(model.state_dict(), shape, kind=kind).items()}
    return HFStyleGPT(_Shards(shards), kind=kind, hf_config=model.config,
                      hf_names=[n for n, _ in model.named_parameters()], shape=shape, tp_group=group)


def _tied_lm(seed: int = 0) -> nn.Module:
    """A Qwen2 (q/k/v biases, tied LM head) over the character tokenizer, random biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=TOK.pad_token_id, use_sliding_window=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return model


def _check_face(rank: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = _tied_lm()
    state = model.state_dict()
    pair = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    alone = dist.new_group([rank], use_local_synchronization=True)
    for group, layout in ((pair.get_group("tp"), Layout(t=2)), (alone, Layout())):
        face = _megatron_face(model, kind="causal_lm", group=group)
        full = dict(face.named_full_weights())  # the rollout engine's update_weights and the export read these
        assert full.keys() == state.keys()
        assert all(torch.equal(full[n], state[n]) for n in state)
        # weights(): the same rows as the native engine's tensor parallelism on the same layout.
        ctx = WorkerContext(role="actor", pool="p", rank=group.rank(), world_size=layout.t, global_rank=rank,
                            layout=layout, device=torch.device("cpu"), process_group=None, mesh=None)
        mine = weight_rows(face, ctx, version=3)
        if layout.t == 2:
            native = TrainingEngine(copy.deepcopy(model), config=TrainingConfig(), mesh=pair)
            theirs = weight_rows(native.model, dataclasses.replace(ctx, mesh=pair), version=3)
        else:
            theirs = weight_rows(model, ctx, version=3)
        assert list(mine) == list(theirs)
        assert all(torch.equal(mine[n], theirs[n]) for n in mine)
        rows = [None] * layout.t
        dist.all_gather_object(rows, mine, group=group)
        joined = {n: torch.cat([r[n] for r in rows]) for n in mine}
        whole, version = assemble_weights(joined, {n: tuple(p.shape) for n, p in model.named_parameters()})
        assert version == 3 and all(torch.equal(whole[n], p) for n, p in model.named_parameters())
    (out / f"ok{rank}").touch()


def test_a_megatron_model_gives_the_native_engines_weights_rows_and_full_weights(tmp_path: Path) -> None:
    out = run_ranks(2, _check_face, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["ok0", "ok1"]


@pytest.fixture
def alone(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo default group, and this rank as a group."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["causal_lm", "value"])
def test_a_megatron_model_saves_as_its_source_architecture(alone: dist.ProcessGroup, tmp_path: Path,
                                                           kind: str) -> None:
    from transformers import AutoModelForCausalLM

    from workers.models import save_pretrained_here

    model = _tied_lm()
    if kind == "value":
        model = ValueModel.from_causal_lm(model, seed=1)
    face = _megatron_face(model, kind=kind, group=alone)
    # What an actor's export does with the engine's model (and the engine's default export).
    save_pretrained_here(face, tmp_path / "out", state_dict=dict(face.named_full_weights()))  # type: ignore[arg-type]
    back = (ValueModel.from_pretrained(tmp_path / "out") if kind == "value"
            else AutoModelForCausalLM.from_pretrained(tmp_path / "out"))
    loaded, want = back.state_dict(), model.state_dict()
    assert loaded.keys() == want.keys()
    assert all(torch.equal(loaded[n], want[n]) for n in want)


# ------------------------------------------------------------------- roles (GPU)

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_MEGATRON), reason="needs CUDA and megatron-core")
FP32 = {"precision": "fp32"}  # compared with the native roles in float32 ("auto" is bf16 on a GPU)


@pytest.fixture
def nccl_alone(tmp_path: Path) -> Iterator[None]:
    """A one-rank NCCL default group: Megatron's layers take process groups even alone."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cuda_ctx(role: str) -> WorkerContext:
    return dataclasses.replace(local_ctx(role), device=torch.device("cuda", 0))


def _rows() -> dict[str, Tensor]:
    rows = random_rows(6, seed=3)
    return rows | {"prompt_ids": rows["prompt_ids"] % TOK.vocab_size,
                   "response_ids": rows["response_ids"] % TOK.vocab_size}


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("nccl_alone")
def test_megatron_actor_and_reference_match_the_native_roles_and_train(model_dir: str, tmp_path: Path) -> None:
    training = TrainingConfig(lr=1e-3, **FP32)
    actors = {e: ActorWorker(_cuda_ctx("actor"), ActorConfig(model_dir=model_dir, training=training, engine=e))
              for e in ("native", "megatron")}
    refs = {e: ReferenceWorker(_cuda_ctx("ref"), ReferenceConfig(model_dir=model_dir, training=training, engine=e))
            for e in ("native", "megatron")}
    assert isinstance(actors["megatron"].engine, MegatronTrainingEngine)
    rows = Batch(_rows())
    mine, theirs = actors["megatron"].log_prob(rows), actors["native"].log_prob(rows)
    torch.testing.assert_close(mine["old_logprobs"].cpu(), theirs["old_logprobs"].cpu(), atol=1e-4, rtol=0)
    torch.testing.assert_close(refs["megatron"].log_prob(rows)["ref_logprobs"].cpu(),
                               refs["native"].log_prob(rows)["ref_logprobs"].cpu(), atol=1e-4, rtol=0)
    m, n = actors["megatron"].update(rows), actors["native"].update(rows)
    assert m["actor/loss"] == pytest.approx(n["actor/loss"], abs=1e-5)
    assert m["actor/grad_norm"] == pytest.approx(n["actor/grad_norm"], rel=1e-3)
    assert m["actor/steps"] == 1.0
    # The update reached the rollout engine: it holds the training engine's new weights.
    engine, rollout = actors["megatron"].engine, actors["megatron"].rollout
    assert rollout is not None
    full = dict(engine.named_full_weights())
    for name, param in rollout.model.named_parameters():  # type: ignore[attr-defined]
        torch.testing.assert_close(param.detach(), full[name], atol=0, rtol=0)
    published = actors["megatron"].weights()
    assert list(published) == list(actors["native"].weights())
    actors["megatron"].export_hf(str(tmp_path / "policy"))
    exported = load_model(str(tmp_path / "policy"))
    for name, param in exported.named_parameters():
        torch.testing.assert_close(param, full[name].cpu(), atol=0, rtol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.usefixtures("nccl_alone")
def test_megatron_critic_matches_the_native_critic_and_trains(model_dir: str) -> None:
    training = TrainingConfig(lr=1e-3, **FP32)
    critics = {e: CriticWorker(_cuda_ctx("critic"), CriticConfig(model_dir=model_dir, training=training, engine=e))
               for e in ("native", "megatron")}
    rows = _rows()
    values = {e: c.values(Batch(rows))["values"].cpu() for e, c in critics.items()}
    torch.testing.assert_close(values["megatron"], values["native"], atol=1e-4, rtol=0)
    batch = Batch(rows | {"values": values["native"], "returns": torch.randn(6, 6) * rows["response_mask"]})
    m, n = critics["megatron"].update(batch), critics["native"].update(batch)
    assert m["critic/loss"] == pytest.approx(n["critic/loss"], abs=1e-5)
    assert m["critic/grad_norm"] == pytest.approx(n["critic/grad_norm"], rel=1e-3)
