"""TrainingConfig.precision on one process (CPU autocast): bf16 compute with float32
master weights, optimizer state and outputs; inference-only engines in bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engines_testlib import EXACT, TinyValueModel, full_weights, make_batch, tiny_lm
from torch import nn

from workers.engines import (
    EngineConfigError,
    TrainingConfig,
    TrainingEngine,
    ValueHead,
    resolve_precision,
)
from workers.objectives import PolicyLoss, ValueLoss

torch.set_num_threads(1)

LOSS = PolicyLoss(kl_coef=0.05, entropy_coef=0.01)


def _dtypes_seen(module: nn.Module) -> list[torch.dtype]:
    """Records the dtype of every output of ``module`` from now on."""
    seen: list[torch.dtype] = []
    module.register_forward_hook(lambda _m, _args, out: seen.append(out.dtype))
    return seen


def _grad_dtypes(engine: TrainingEngine) -> list[torch.dtype]:
    """Records the dtype of every gradient the optimizer steps with from now on."""
    seen: list[torch.dtype] = []
    engine.optimizer.register_step_pre_hook(  # type: ignore[union-attr]
        lambda opt, _a, _k: seen.extend(p.grad.dtype for g in opt.param_groups for p in g["params"])
    )
    return seen


def _update(before: dict, after: dict) -> torch.Tensor:
    return torch.cat([(after[n] - before[n]).flatten() for n in before])


def test_bf16_step_is_close_to_the_fp32_step() -> None:
    batch = make_batch()
    before = full_weights(TrainingEngine(tiny_lm(), config=TrainingConfig(**EXACT)))
    results = {}
    for precision in ("fp32", "bf16"):
        config = TrainingConfig(**EXACT, micro_batch_size=3, precision=precision)
        engine = TrainingEngine(tiny_lm(), config=config, loss=LOSS)
        logprobs, _ = engine.log_probs(batch)
        metrics = engine.train_step(batch)
        results[precision] = (logprobs, metrics, _update(before, full_weights(engine)))
    (lp32, m32, u32), (lp16, m16, u16) = results["fp32"], results["bf16"]
    # bf16 keeps 8 significant bits: per-element errors of a few 1e-3 on log-probs,
    # well under 1 % on the loss, the gradient norm and the whole update.
    torch.testing.assert_close(lp16, lp32, rtol=0, atol=2e-2)
    assert (lp16 != lp32).any()  # the bf16 engine really computed something else
    for key in ("loss", "grad_norm", "entropy", "kl"):
        assert m16[key] == pytest.approx(m32[key], rel=1e-2), key
    assert float((u16 - u32).norm() / u32.norm()) < 2e-2


def test_bf16_computes_in_bf16_and_keeps_float32_master_weights_and_state() -> None:
    batch = make_batch()
    engines = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        engine = TrainingEngine(tiny_lm(), config=TrainingConfig(**EXACT, precision=precision), loss=LOSS)
        q_proj = _dtypes_seen(engine.model.model.layers[0].self_attn.q_proj)
        lm_head = _dtypes_seen(engine.model.lm_head)
        grads = _grad_dtypes(engine)
        logprobs, entropy = engine.log_probs(batch)
        engine.train_step(batch)
        assert set(q_proj) == set(lm_head) == {dtype}, precision
        assert logprobs.dtype == entropy.dtype == torch.float32
        assert grads and set(grads) == {torch.float32}
        assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
        states = [t for s in engine.optimizer.state.values() for t in s.values()]  # type: ignore[union-attr]
        assert states and {t.dtype for t in states} == {torch.float32}
        engines[precision] = engine
    assert engines["bf16"].precision == "bf16" and engines["fp32"].precision == "fp32"


def test_bf16_value_model_returns_float32_values_close_to_fp32() -> None:
    batch = make_batch()
    values = {}
    for precision in ("fp32", "bf16"):
        config = TrainingConfig(**EXACT, precision=precision)
        critic = TrainingEngine(TinyValueModel(), config=config, head=ValueHead(), loss=ValueLoss())
        values[precision] = critic.values(batch)
        assert values[precision].dtype == torch.float32
        assert critic.train_step(batch)["loss"] > 0
    torch.testing.assert_close(values["bf16"], values["fp32"], rtol=0, atol=3e-2)


def test_auto_precision_is_fp32_on_cpu_and_settings_resolve() -> None:
    engine = TrainingEngine(tiny_lm(), config=TrainingConfig())
    assert engine.precision == "fp32"
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32"
    assert resolve_precision("bf16", cpu) == "bf16"
    assert resolve_precision("fp32", cpu) == "fp32"


def test_inference_only_bf16_engine_stores_bf16_weights_and_builds_no_optimizer(tmp_path: Path) -> None:
    batch = make_batch()
    reference = TrainingEngine(tiny_lm(), config=TrainingConfig(precision="bf16"), trainable=False)
    full = TrainingEngine(tiny_lm(), config=TrainingConfig(precision="fp32"), trainable=False)
    assert reference.optimizer is None and reference.precision == "bf16"
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in reference.model.parameters())
    # Buffers keep their dtype: rotary frequencies in bf16 would shift every position.
    assert {b.dtype for b in reference.model.buffers()} == {torch.float32}
    assert {p.dtype for p in full.model.parameters()} == {torch.float32}
    assert reference.memory_footprint().params * 2 == full.memory_footprint().params
    assert reference.memory_footprint().optimizer_state == 0

    logprobs, entropy = reference.log_probs(batch)
    assert logprobs.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logprobs, full.log_probs(batch)[0], rtol=0, atol=5e-2)
    with pytest.raises(EngineConfigError, match="trainable=False"):
        reference.train_step(batch, loss=LOSS)

    reference.save(tmp_path / "ckpt")  # model only: there is no optimizer state
    restored = TrainingEngine(tiny_lm(seed=5), config=TrainingConfig(precision="bf16"), trainable=False)
    restored.load(tmp_path / "ckpt")
    torch.testing.assert_close(restored.log_probs(batch)[0], logprobs, rtol=0, atol=0)


def test_inference_only_bf16_value_model_returns_float32() -> None:
    critic = TrainingEngine(
        TinyValueModel(), config=TrainingConfig(precision="bf16"), head=ValueHead(), trainable=False
    )
    assert {p.dtype for p in critic.model.parameters()} == {torch.bfloat16}
    assert critic.values(make_batch()).dtype == torch.float32


def test_precision_errors_name_the_field() -> None:
    with pytest.raises(EngineConfigError, match=r"TrainingConfig\.precision must be one of"):
        TrainingConfig(precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match=r"TrainingConfig\.activation_checkpointing"):
        TrainingConfig(activation_checkpointing="yes")  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match=r"TrainingConfig\.precision"):
        resolve_precision("half", torch.device("cpu"))
