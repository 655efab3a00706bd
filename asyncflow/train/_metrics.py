"""Where a run's metrics go: a JSONL file, TensorBoard, a progress bar, and a PNG
of the curves at the end; pass@k of sampled held-out responses."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

logger = logging.getLogger(__name__)


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors the numbers
    to TensorBoard (``tensorboard/`` beside it).

    Args:
        directory: the run's directory (``<output_dir>/version_<n>``).
        tensorboard: write TensorBoard event files too.
    """

    def __init__(self, directory: Path, *, tensorboard: bool = True) -> None:
        self.path = directory / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(directory / "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` of ``step`` (flushed at once: a crash loses nothing)."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        """Close the files."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Rows of a ``metrics.jsonl`` (the last row of a step wins)."""
    by_step: dict[int, dict[str, float]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                by_step[int(row["step"])] = by_step.get(int(row["step"]), {}) | row
    return [by_step[s] for s in sorted(by_step)]


def truncate_after(path: Path, step: int) -> None:
    """Drop rows of steps after ``step`` (a resumed run re-does them)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and int(json.loads(line)["step"]) <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def plot_curves(rows: list[dict[str, float]], out: Path, keys: tuple[str, ...]) -> Path | None:
    """A PNG with one panel per metric in ``keys`` that the rows carry.

    Returns:
        The PNG's path, or None when no row has any of the keys.
    """
    present = [k for k in keys if any(k in r for r in rows)]
    if not present:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.6 * len(present)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], present, strict=True):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def pass_at_k(uid: Tensor, scores: Tensor, *, n: int, threshold: float) -> dict[str, float]:
    """``eval/mean@n`` and the unbiased ``eval/pass@k`` (Chen et al., 2021) for k =
    1, 2, 4, ... up to ``n``, over prompts with ``n`` sampled responses each.

    Args:
        uid: ``[rows]`` the prompt of each response.
        scores: ``[rows]`` each response's reward.
        n: responses per prompt.
        threshold: a response with a reward at least this is correct.

    Returns:
        ``{"eval/mean@n": mean reward, "eval/pass@k": mean over prompts of
        1 - C(n - c, k) / C(n, k)}`` (``c``: the prompt's correct responses).
    """
    correct: dict[int, int] = {}
    counts: dict[int, int] = {}
    for u, s in zip(uid.tolist(), scores.tolist(), strict=True):
        counts[u] = counts.get(u, 0) + 1
        correct[u] = correct.get(u, 0) + (s >= threshold)
    if any(c != n for c in counts.values()):
        raise ValueError(f"pass_at_k: every prompt needs {n} responses, got {sorted(set(counts.values()))}")
    out = {f"eval/mean@{n}": float(scores.float().mean())}
    k = 1
    while k <= n:
        out[f"eval/pass@{k}"] = sum(1.0 - math.comb(n - c, k) / math.comb(n, k) for c in correct.values()) / len(counts)
        k *= 2
    return out


def progress_bar(enabled: bool, start: int, total: int) -> Any:
    """A tqdm bar over the RL steps (None when not ``enabled``)."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="RL", unit="step", dynamic_ncols=True)


def advance_bar(bar: Any, m: dict[str, float]) -> None:
    """One step on ``bar`` (if any), showing the step's reward, KL, tokens/s and mismatch."""
    if bar is None:
        return
    shown = {"reward": m.get("reward/mean"), "kl": m.get("actor/kl_to_ref", m.get("actor/approx_kl")),
             "tok/s": m.get("throughput/tokens_per_s"), "mismatch": m.get("actor/logprob_mismatch")}
    bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if v is not None}, refresh=False)
    bar.update(1)
