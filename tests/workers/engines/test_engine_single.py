"""TrainingEngine in one process: log-probs, micro-batching, checkpoints, HF export."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from engines_testlib import EXACT, TinyValueModel, full_weights, make_batch, tiny_lm
from transformers import LlamaForCausalLM

from channels import ConfigError
from workers.engines import EngineConfigError, TrainingConfig, TrainingEngine, ValueHead
from workers.engines._optimizer import build_adamw
from workers.objectives import LossAggregation, NLLLoss, PolicyLoss, ValueLoss

torch.set_num_threads(1)


def _direct_logprobs(model: torch.nn.Module, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """Untrimmed forward of prompt ++ response; log_softmax gather at positions P+j-1."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    prompt, response = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    logits = logits[:, prompt - 1 : prompt + response - 1] / temperature
    picked = torch.log_softmax(logits, -1).gather(-1, batch["response_ids"][..., None])
    return picked.squeeze(-1) * batch["response_mask"]


def test_log_probs_equal_direct_forward_gather() -> None:
    batch = make_batch()
    engine = TrainingEngine(tiny_lm(), config=TrainingConfig(micro_batch_size=3))
    for temperature in (1.0, 0.6):
        logprobs, entropy = engine.log_probs(batch, temperature=temperature)
        expected = _direct_logprobs(engine.model, batch, temperature)
        torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
    assert entropy.shape == logprobs.shape
    assert (entropy[batch["response_mask"] == 0] == 0).all()
    assert (entropy[batch["response_mask"] == 1] > 0).all()
    alone, none = engine.log_probs(batch, temperature=0.6, entropy=False)  # the reference's call
    assert none is None
    assert torch.equal(alone, logprobs)


def test_forwards_run_in_eval_mode_and_steps_in_training_mode_and_each_leaves_it() -> None:
    def modes(model: torch.nn.Module) -> set[bool]:
        return {m.training for m in model.modules()}

    batch = make_batch()
    engine = TrainingEngine(tiny_lm(), config=TrainingConfig(lr=1e-2), loss=NLLLoss())
    seen: list[set[bool]] = []
    hook = engine.model.model.layers[0].register_forward_pre_hook(lambda m, _: seen.append(modes(engine.model)))
    engine.model.eval()
    engine.log_probs(batch)
    engine.train_step(batch)
    assert modes(engine.model) == {True}, "a step leaves the whole model in training mode"
    engine.log_probs(batch)
    assert modes(engine.model) == {True}, "a forward leaves the mode it found"
    engine.train_step(batch)
    assert seen == [{False}, {True}, {False}, {True}]
    hook.remove()
    reference = TrainingEngine(tiny_lm(), config=TrainingConfig(), trainable=False)
    reference.model.eval()
    reference.log_probs(batch)
    assert modes(reference.model) == {False}


def test_values_read_positions_before_each_response_token() -> None:
    batch = make_batch()
    engine = TrainingEngine(TinyValueModel(), config=TrainingConfig(), head=ValueHead())
    values = engine.values(batch)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    with torch.no_grad():
        out = engine.model(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    prompt, response = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    expected = out[:, prompt - 1 : prompt + response - 1] * batch["response_mask"]
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(EngineConfigError, match="CausalLMHead"):
        engine.log_probs(batch)




def _step(config: TrainingConfig, loss: object, batch: dict, *, value: bool = False) -> tuple:
    if value:
        engine = TrainingEngine(TinyValueModel(), config=config, head=ValueHead(), loss=loss)
    else:
        engine = TrainingEngine(tiny_lm(), config=config, loss=loss)
    metrics = engine.train_step(batch)
    return metrics, full_weights(engine)


@pytest.mark.parametrize("aggregation", list(LossAggregation))
def test_micro_batched_step_equals_full_batch_step(aggregation: LossAggregation) -> None:
    batch = make_batch(rows=7)
    loss = PolicyLoss(dual_clip=3.0, entropy_coef=0.01, kl_coef=0.05)
    base = {**EXACT, "loss_aggregation": aggregation, "grad_clip": 0.5}
    full_metrics, full = _step(TrainingConfig(**base), loss, batch)
    for micro in ({"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 20}):
        metrics, weights = _step(TrainingConfig(**base, **micro), loss, batch)
        for key in ("loss", "grad_norm", "clip_fraction", "entropy", "kl"):
            assert metrics[key] == pytest.approx(full_metrics[key], rel=1e-5, abs=1e-7), key
        for name, tensor in full.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6)
    assert full_metrics["grad_norm"] > 0.5  # the clip was active


def test_value_model_micro_batched_step_equals_full_batch_step() -> None:
    batch = make_batch(rows=6)
    full_metrics, full = _step(TrainingConfig(**EXACT), ValueLoss(), batch, value=True)
    config = TrainingConfig(**EXACT, max_tokens_per_micro_batch=16)
    metrics, weights = _step(config, ValueLoss(), batch, value=True)
    assert metrics["loss"] == pytest.approx(full_metrics["loss"], rel=1e-5)
    for name, tensor in full.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6)


def test_warmup_schedule_and_checkpoint_resume(tmp_path: Path) -> None:
    batch = make_batch()
    config = TrainingConfig(lr=1e-3, warmup_steps=4, micro_batch_size=4)
    engine = TrainingEngine(tiny_lm(), config=config, loss=PolicyLoss())
    assert engine.train_step(batch)["lr"] == pytest.approx(2.5e-4)
    engine.save(tmp_path / "ckpt")
    expected = engine.train_step(batch)
    expected_weights = full_weights(engine)

    resumed = TrainingEngine(tiny_lm(seed=7), config=config, loss=PolicyLoss())
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 1
    got = resumed.train_step(batch)
    assert got["lr"] == pytest.approx(5e-4)
    assert got["loss"] == expected["loss"]
    assert got["grad_norm"] == expected["grad_norm"]
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(full_weights(resumed)[name], tensor, rtol=0, atol=0)
    with pytest.raises(EngineConfigError, match="no checkpoint"):
        resumed.load(tmp_path / "missing")


def test_export_hf_loads_with_transformers_and_gives_identical_logits(tmp_path: Path) -> None:
    engine = TrainingEngine(tiny_lm(), config=TrainingConfig(lr=1e-2), loss=NLLLoss())
    engine.train_step(make_batch())
    engine.export_hf(tmp_path / "hf")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, engine.model(ids).logits, rtol=0, atol=0)
    names = [name for name, _ in engine.named_full_weights()]
    assert names == list(loaded.state_dict())


def test_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(EngineConfigError, match="not both"):
        TrainingConfig(micro_batch_size=2, max_tokens_per_micro_batch=10)
    with pytest.raises(EngineConfigError, match=r"TrainingConfig\.lr"):
        TrainingConfig(lr=-1.0)
    with pytest.raises(ConfigError, match="dual_clip"):
        PolicyLoss(dual_clip=0.5)
    engine = TrainingEngine(tiny_lm(), config=TrainingConfig(), loss=PolicyLoss(kl_coef=0.1))
    batch = make_batch()
    del batch["ref_logprobs"]
    with pytest.raises(EngineConfigError, match="'ref_logprobs'"):
        engine.train_step(batch)
    with pytest.raises(ConfigError, match="ValueHead"):
        engine.train_step(make_batch(), loss=ValueLoss())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu_engine() -> None:
    batch = make_batch()
    # fp32 on both: "auto" would pick bf16 on CUDA (test_precision covers bf16).
    config = TrainingConfig(**EXACT, precision="fp32")
    cpu = TrainingEngine(tiny_lm(), config=config, loss=PolicyLoss())
    gpu = TrainingEngine(tiny_lm().cuda(), config=config, loss=PolicyLoss())
    assert gpu.device.type == "cuda" and gpu.precision == "fp32"
    torch.testing.assert_close(
        gpu.log_probs(batch)[0].cpu(), cpu.log_probs(batch)[0], rtol=1e-4, atol=1e-4
    )
    assert gpu.train_step(batch)["loss"] == pytest.approx(cpu.train_step(batch)["loss"], rel=1e-4)


def test_the_cpu_optimizer_runs_fused_adamw_and_steps_as_the_per_tensor_loop() -> None:
    model = tiny_lm()
    twin = copy.deepcopy(model)
    config = TrainingConfig(lr=1e-2, weight_decay=0.1)
    fused = build_adamw(model, config, torch.device("cpu"))
    assert [g["weight_decay"] for g in fused.param_groups] == [0.1, 0.0]
    assert all(g.get("fused") for g in fused.param_groups)
    names = {id(p): name for name, p in model.named_parameters()}
    twins = dict(twin.named_parameters())
    loop = torch.optim.AdamW([{"params": [twins[names[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
                              for g in fused.param_groups], lr=config.lr, betas=config.betas, eps=config.eps)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for name, p in model.named_parameters():
            p.grad = torch.randn(p.shape, generator=gen)
            twins[name].grad = p.grad.clone()
        fused.step()
        loop.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, twins[name], rtol=1e-5, atol=1e-6, msg=name)
