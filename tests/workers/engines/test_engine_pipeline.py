"""TrainingEngine with pipeline stages (``pp`` 2 and 4, 1F1B and interleaved) over
real gloo process groups: log-probs, values, metrics and weights equal one process's;
checkpoints and HF export of the stages; an actor and a critic updated in one fused
schedule equal the two updates one after the other.

Each rank keeps its stage's layers under their own names, so its weights compare
with the single process's by name."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from engines_testlib import EXACT, TinyValueModel, make_batch, run_ranks, tiny_config, tiny_lm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from workers.engines import (
    MESH_DIM_NAMES,
    EngineConfigError,
    TrainingConfig,
    TrainingEngine,
    ValueHead,
    fused_train_steps,
)
from workers.objectives import PolicyLoss, ValueLoss

torch.set_num_threads(1)

CONFIG = EXACT | {"grad_clip": 1.0}
LOSS = PolicyLoss(dual_clip=3.0, kl_coef=0.05)
LAYERS = 4


def _weights(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    """This rank's parameters, by the whole model's names."""
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def _full_weights(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    """The whole model's parameters, gathered (collective)."""
    return {name: t.detach().clone() for name, t in engine.named_full_weights()}


def _assert_weights_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                          exact: bool = False) -> None:
    """Equal weights: bit for bit when ``exact`` (the same rank and layout), else within
    the tolerance of another layout's arithmetic."""
    assert got.keys() == expected.keys()
    tolerance = 0.0 if exact else 1e-5
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=tolerance, atol=tolerance, msg=name)


def _optimizer_state(engine: TrainingEngine) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state (AdamW: ``step``, ``exp_avg``,
    ``exp_avg_sq``) by parameter name, cloned (this rank's shard of a DTensor)."""
    assert engine.optimizer is not None
    names = {id(p): name for name, p in engine.model.named_parameters()}
    return {names[id(p)]: {key: (value.to_local() if isinstance(value, DTensor) else torch.as_tensor(value)).clone()
                           for key, value in state.items()}
            for p, state in engine.optimizer.state.items()}


def _assert_optimizer_state_close(got: dict[str, dict[str, torch.Tensor]],
                                  expected: dict[str, dict[str, torch.Tensor]], *, exact: bool = False) -> None:
    """Equal optimizer states, every parameter's moments and step present: the
    weights after one more step can hide lost moments (AdamW with ``eps=1`` moves
    them by ``lr`` times about the gradient either way)."""
    assert expected and all(expected.values())  # there is a state to compare
    assert got.keys() == expected.keys()
    for param, state in expected.items():
        assert got[param].keys() == state.keys(), param
        for key, tensor in state.items():
            if exact:
                torch.testing.assert_close(got[param][key], tensor, rtol=0, atol=0, msg=f"{param} {key}")
            else:  # moments are ~grad and ~grad**2: a tolerance relative to the largest
                scale = float(tensor.abs().max())
                torch.testing.assert_close(got[param][key], tensor, rtol=1e-5, atol=1e-5 * scale,
                                           msg=f"{param} {key}")


def _run(engine: TrainingEngine, steps: int) -> dict:
    batch = make_batch()
    logprobs, entropy = engine.log_probs(batch)
    metrics = [engine.train_step(batch) for _ in range(steps)]
    return {"logprobs": logprobs, "entropy": entropy, "metrics": metrics, "weights": _weights(engine)}


def _critic_run(engine: TrainingEngine) -> dict:
    batch = make_batch()
    values = engine.values(batch)
    return {"values": values, "metrics": [engine.train_step(batch)], "weights": _weights(engine)}


def _pipeline_ranks(rank: int, out: Path, *, pp: int, chunks: int, micro: int, reverse: bool) -> None:
    mesh = init_device_mesh("cpu", (pp, 1, 1), mesh_dim_names=MESH_DIM_NAMES)
    config = TrainingConfig(**CONFIG, micro_batch_size=micro, pipeline_chunks=chunks, pipeline_reversed=reverse)
    actor = TrainingEngine(tiny_lm(layers=LAYERS), config=config, mesh=mesh, loss=LOSS)
    result = {"actor": _run(actor, steps=1)}
    # A checkpoint of the stages resumes exactly, here and in one process (the test).
    actor.save(out / "ckpt")
    saved_state = _optimizer_state(actor)
    result["actor"]["metrics"].append(actor.train_step(make_batch()))
    result["actor"]["weights"] = _weights(actor)
    result["actor"]["full"] = {name: t.clone() for name, t in actor.named_full_weights()}
    actor.export_hf(out / "hf")
    resumed = TrainingEngine(tiny_lm(layers=LAYERS, seed=5), config=config, mesh=mesh, loss=LOSS)
    resumed.load(out / "ckpt")
    # The metrics come before the optimizer step: the optimizer state (AdamW's moments
    # and step) and the weights after the step show that it resumed too.
    _assert_optimizer_state_close(_optimizer_state(resumed), saved_state, exact=True)
    result["resumed"] = resumed.train_step(make_batch())
    _assert_weights_close(_weights(resumed), result["actor"]["weights"], exact=True)
    result["resumed_weights"] = _weights(resumed)
    if chunks == 1:
        critic = TrainingEngine(TinyValueModel(layers=LAYERS), config=config, mesh=mesh, head=ValueHead(),
                                loss=ValueLoss())
        result["critic"] = _critic_run(critic)
    torch.save(result, out / f"pp{rank}.pt")


def _assert_close_metrics(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize(("pp", "chunks", "micro", "reverse"),
                         [(2, 1, 3, False), (2, 2, 3, False), (4, 1, 2, False), (2, 2, 3, True)],
                         ids=["pp2-1f1b", "pp2-interleaved", "pp4-1f1b", "pp2-interleaved-reversed"])
def test_pipelined_engine_equals_one_process(tmp_path: Path, pp: int, chunks: int, micro: int,
                                             reverse: bool) -> None:
    out = run_ranks(pp, functools.partial(_pipeline_ranks, pp=pp, chunks=chunks, micro=micro, reverse=reverse),
                    tmp_path)
    config = TrainingConfig(**CONFIG, micro_batch_size=micro)
    expected = _run(TrainingEngine(tiny_lm(layers=LAYERS), config=config, loss=LOSS), steps=2)
    critic = _critic_run(TrainingEngine(TinyValueModel(layers=LAYERS), config=config, head=ValueHead(),
                                        loss=ValueLoss()))
    seen: set[str] = set()
    loaded = TrainingEngine(tiny_lm(layers=LAYERS, seed=5), config=config, loss=LOSS)
    loaded.load(out / "ckpt")  # the stages' checkpoint in one process
    reloaded = TrainingEngine(tiny_lm(layers=LAYERS), config=config, loss=LOSS)
    reloaded.train_step(make_batch())
    _assert_optimizer_state_close(_optimizer_state(loaded), _optimizer_state(reloaded))
    one_step = reloaded.train_step(make_batch())
    _assert_close_metrics(loaded.train_step(make_batch()), one_step)
    _assert_weights_close(_weights(loaded), _weights(reloaded))
    exported = LlamaForCausalLM.from_pretrained(out / "hf")
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, expected["weights"][name], rtol=1e-5, atol=1e-5, msg=name)
    for rank in range(pp):
        got = torch.load(out / f"pp{rank}.pt", weights_only=False)
        _assert_close_metrics(got["resumed"], expected["metrics"][1])
        for name, tensor in got["resumed_weights"].items():
            torch.testing.assert_close(tensor, expected["weights"][name], rtol=1e-5, atol=1e-5, msg=name)
        assert got["actor"]["full"].keys() == expected["weights"].keys()
        for name, tensor in got["actor"]["full"].items():
            torch.testing.assert_close(tensor, expected["weights"][name], rtol=1e-5, atol=1e-5, msg=name)
        for role, reference in [("actor", expected)] + ([("critic", critic)] if chunks == 1 else []):
            mine = got[role]
            for field in ("logprobs", "entropy", "values"):
                if field in reference:  # every stage returns the last stage's outputs
                    torch.testing.assert_close(mine[field], reference[field], rtol=1e-5, atol=1e-6)
            for got_m, exp_m in zip(mine["metrics"], reference["metrics"], strict=True):
                _assert_close_metrics(got_m, exp_m)
            for name, tensor in mine["weights"].items():
                torch.testing.assert_close(tensor, reference["weights"][name], rtol=1e-5, atol=1e-5, msg=name)
                seen.add(f"{role}:{name}")
    # The stages together hold every parameter once.
    assert seen == {f"actor:{n}" for n in expected["weights"]} | (
        {f"critic:{n}" for n in critic["weights"]} if chunks == 1 else set())


def test_checkpoints_with_the_optimizer_state_in_one_list_still_load(tmp_path: Path) -> None:
    """Checkpoints now hold the optimizer's settings by parameter name (stages hold
    different parameters); those written before, with one nested list, resume too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict


    config = TrainingConfig(**CONFIG)
    engine = TrainingEngine(tiny_lm(), config=config, loss=LOSS)
    engine.train_step(make_batch())
    model_state, optim_state = get_state_dict(engine.model, [engine.optimizer])  # the nested form
    dcp.save({"model": model_state, "optim": optim_state, "engine": {"step": torch.tensor(1)}},
             checkpoint_id=str(tmp_path / "old"), no_dist=True)
    engine.save(tmp_path / "new")
    saved_state = _optimizer_state(engine)
    expected_metrics = engine.train_step(make_batch())  # the uninterrupted second step
    expected_weights = _weights(engine)
    for name in ("old", "new"):
        resumed = TrainingEngine(tiny_lm(seed=4), config=config, loss=LOSS)
        resumed.load(tmp_path / name)
        assert resumed.step == 1
        # The optimizer state came back, tensor for tensor, so the next step's metrics
        # (computed before the optimizer step) and the weights after it are the
        # uninterrupted engine's.
        _assert_optimizer_state_close(_optimizer_state(resumed), saved_state, exact=True)
        _assert_close_metrics(resumed.train_step(make_batch()), expected_metrics)
        _assert_weights_close(_weights(resumed), expected_weights, exact=True)


def _fused_ranks(rank: int, out: Path, *, pp: int) -> None:
    mesh = init_device_mesh("cpu", (pp, 1, 1), mesh_dim_names=MESH_DIM_NAMES)

    def engines() -> tuple[TrainingEngine, TrainingEngine]:
        actor = TrainingEngine(tiny_lm(layers=LAYERS), config=TrainingConfig(**CONFIG, micro_batch_size=2),
                               mesh=mesh, loss=LOSS)
        critic = TrainingEngine(TinyValueModel(layers=LAYERS),
                                config=TrainingConfig(**CONFIG, micro_batch_size=3, pipeline_reversed=True),
                                mesh=mesh, head=ValueHead(), loss=ValueLoss())
        return actor, critic

    batch = make_batch()
    actor, critic = engines()
    fused = [fused_train_steps(actor, batch, critic, batch) for _ in range(2)]
    one, other = engines()
    serial = [(one.train_step(batch), other.train_step(batch)) for _ in range(2)]
    with pytest.raises(EngineConfigError, match="opposite directions"):
        fused_train_steps(actor, batch, one, batch)
    torch.save({"fused": fused, "serial": serial, "weights": (_weights(actor), _weights(critic)),
                "serial_weights": (_weights(one), _weights(other))}, out / f"fused{rank}.pt")


@pytest.mark.parametrize("pp", [2, 4])
def test_a_fused_actor_critic_step_equals_the_two_updates_one_after_the_other(tmp_path: Path, pp: int) -> None:
    out = run_ranks(pp, functools.partial(_fused_ranks, pp=pp), tmp_path)
    actor = TrainingEngine(tiny_lm(layers=LAYERS), config=TrainingConfig(**CONFIG, micro_batch_size=2), loss=LOSS)
    critic = TrainingEngine(TinyValueModel(layers=LAYERS), config=TrainingConfig(**CONFIG, micro_batch_size=3),
                            head=ValueHead(), loss=ValueLoss())
    batch = make_batch()
    alone = [(actor.train_step(batch), critic.train_step(batch)) for _ in range(2)]
    reference = (dict(actor.model.named_parameters()), dict(critic.model.named_parameters()))
    for rank in range(pp):
        got = torch.load(out / f"fused{rank}.pt", weights_only=False)
        for fused, serial, expected in zip(got["fused"], got["serial"], alone, strict=True):
            for f, s, e in zip(fused, serial, expected, strict=True):
                _assert_close_metrics(f, s)
                _assert_close_metrics(f, e)
        for mine, serial, expected in zip(got["weights"], got["serial_weights"], reference, strict=True):
            for name, tensor in mine.items():
                torch.testing.assert_close(tensor, serial[name], rtol=1e-5, atol=1e-6, msg=name)
                torch.testing.assert_close(tensor, expected[name].detach(), rtol=1e-5, atol=1e-5, msg=name)


def _tied_lm(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = tiny_config(layers=LAYERS)
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _tied_ranks(rank: int, out: Path) -> None:
    mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=MESH_DIM_NAMES)
    engine = TrainingEngine(_tied_lm(), config=TrainingConfig(**CONFIG, micro_batch_size=3), mesh=mesh, loss=LOSS)
    result = _run(engine, steps=2)
    result["full"] = {name: t.clone() for name, t in engine.named_full_weights()}
    engine.save(out / "tied-ckpt")
    torch.save(result, out / f"tied{rank}.pt")


def test_tied_embeddings_train_in_two_stages_like_one_process(tmp_path: Path) -> None:
    """The first stage's embedding and the last stage's head are copies of one weight:
    their gradients are summed and the norm counts the weight once, so both copies
    follow the tied weight of one process."""
    out = run_ranks(2, _tied_ranks, tmp_path)
    engine = TrainingEngine(_tied_lm(), config=TrainingConfig(**CONFIG, micro_batch_size=3), loss=LOSS)
    expected = _run(engine, steps=2)
    tied = expected["weights"]["model.embed_tokens.weight"]
    for rank in range(2):
        got = torch.load(out / f"tied{rank}.pt", weights_only=False)
        torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-6)
        for got_m, exp_m in zip(got["metrics"], expected["metrics"], strict=True):
            _assert_close_metrics(got_m, exp_m)
        copy = got["weights"].get("model.embed_tokens.weight", got["weights"].get("lm_head.weight"))
        torch.testing.assert_close(copy, tied, rtol=1e-5, atol=1e-6)
        for name, tensor in got["weights"].items():
            reference = tied if name == "lm_head.weight" else expected["weights"][name]
            torch.testing.assert_close(tensor, reference, rtol=1e-5, atol=1e-5, msg=name)
        # Exported weights carry both names, equal, as the tied model's state dict does.
        torch.testing.assert_close(got["full"]["lm_head.weight"], tied, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["full"]["model.embed_tokens.weight"], tied, rtol=1e-5, atol=1e-6)
    # The stages' checkpoint resumes in one process.
    resumed = TrainingEngine(_tied_lm(seed=5), config=TrainingConfig(**CONFIG, micro_batch_size=3), loss=LOSS)
    resumed.load(out / "tied-ckpt")
    # The optimizer state resumed too (the metrics come before the optimizer step).
    _assert_optimizer_state_close(_optimizer_state(resumed), _optimizer_state(engine))
    _assert_close_metrics(resumed.train_step(make_batch()), engine.train_step(make_batch()))
    _assert_weights_close(_weights(resumed), _weights(engine))


def _mixed_ranks(rank: int, out: Path, *, shape: tuple[int, int, int], data_parallel: str, tied: bool) -> None:
    """Two pipeline stages with tensor or data parallelism inside each stage
    (replicated, or sharded by FSDP2); the stages' checkpoint resumes exactly."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIM_NAMES)
    rows = torch.arange(8) if shape[1] == 1 else (torch.arange(0, 5), torch.arange(5, 8))[mesh["dp"].get_local_rank()]
    batch = {k: v[rows] for k, v in make_batch().items()}
    config = TrainingConfig(**CONFIG, micro_batch_size=2, data_parallel=data_parallel)
    model = _tied_lm if tied else functools.partial(tiny_lm, layers=LAYERS)
    engine = TrainingEngine(model(), config=config, mesh=mesh, loss=LOSS)
    logprobs, _ = engine.log_probs(batch)
    metrics = [engine.train_step(batch) for _ in range(2)]
    full = {name: t.clone() for name, t in engine.named_full_weights()}
    engine.save(out / "mixed-ckpt")
    resumed = TrainingEngine(model(seed=5), config=config, mesh=mesh, loss=LOSS)
    resumed.load(out / "mixed-ckpt")
    # The optimizer state resumed too (the metrics come before the optimizer step).
    _assert_optimizer_state_close(_optimizer_state(resumed), _optimizer_state(engine), exact=True)
    resumed_metrics, continued_metrics = resumed.train_step(batch), engine.train_step(batch)
    torch.save({"logprobs": logprobs, "rows": rows, "metrics": metrics, "full": full,
                "resumed": resumed_metrics, "continued": continued_metrics,
                "resumed_full": _full_weights(resumed), "continued_full": _full_weights(engine)},
               out / f"mixed{rank}.pt")


@pytest.mark.parametrize(("shape", "data_parallel", "tied"),
                         [((2, 1, 2), "replicate", False), ((2, 2, 1), "replicate", False),
                          ((2, 2, 1), "shard", False), ((2, 2, 1), "shard", True), ((2, 1, 2), "replicate", True)],
                         ids=["pp2-tp2", "pp2-dp2", "pp2-dp2-sharded", "pp2-dp2-sharded-tied", "pp2-tp2-tied"])
def test_pipeline_stages_with_tensor_or_data_parallelism_equal_one_process(
        tmp_path: Path, shape: tuple[int, int, int], data_parallel: str, tied: bool) -> None:
    out = run_ranks(4, functools.partial(_mixed_ranks, shape=shape, data_parallel=data_parallel, tied=tied),
                    tmp_path)
    model = _tied_lm() if tied else tiny_lm(layers=LAYERS)
    engine = TrainingEngine(model, config=TrainingConfig(**CONFIG, micro_batch_size=2), loss=LOSS)
    expected = _run(engine, steps=2)
    for rank in range(4):
        got = torch.load(out / f"mixed{rank}.pt", weights_only=False)
        torch.testing.assert_close(got["logprobs"], expected["logprobs"][got["rows"]], rtol=1e-5, atol=1e-6)
        for got_m, exp_m in zip(got["metrics"], expected["metrics"], strict=True):
            _assert_close_metrics(got_m, exp_m)
        for name, tensor in expected["weights"].items():
            torch.testing.assert_close(got["full"][name], tensor, rtol=1e-5, atol=1e-5, msg=name)
        _assert_close_metrics(got["resumed"], got["continued"])
        _assert_weights_close(got["resumed_full"], got["continued_full"], exact=True)
