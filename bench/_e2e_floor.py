"""The end-to-end workload in plain PyTorch, no framework: what its arithmetic
costs on this machine, for ``bench.e2e``.

``python -m bench._e2e_floor --ranks R`` prints one JSON record. Each rank is one
process running the whole GRPO step in eager PyTorch, the way a hand-written
loop would: a KV-cached decode of its share of the prompts (a preallocated
cache, one token per row per step, sampled from the softmax at temperature 1),
the rule reward over the decoded text, the group advantages, the reference's
log-probs (one no-grad forward), and one clipped-ratio update with the KL
penalty, gradient clipping and AdamW. With two ranks each takes half the prompts
(whole groups) and the gradients are averaged with one all-reduce over gloo.
Nothing is scheduled, serialised or sent between processes besides that
all-reduce: the better of these figures is about the fastest the workload's
eager arithmetic runs on this machine, which a framework only adds to. Each rank
runs with the process settings asyncflow's workers have (torch threads, glibc
keeping freed memory: ``workers.host._allocator``; the threads' scheduling
policy: ``workers.host._cpu_policy``), so the two differ by what the framework
does, not by how their processes are set up.
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import queue  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from bench._e2e_job import E2EJob, digit_reward  # noqa: E402

_CLIP = 0.2


def generate(model: Any, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``new_tokens`` per row of ``prompts`` ``[B, P]`` (no padding: the
    workload's prompts have one length); the tokens and their log-probs ``[B, N]``."""
    inner = model.model
    rows, length = prompts.shape
    total = length + new_tokens
    attn0 = inner.layers[0].self_attn
    heads, head_dim = model.config.num_key_value_heads, attn0.head_dim
    keys = [prompts.new_empty((rows, heads, total, head_dim), dtype=torch.float32) for _ in inner.layers]
    values = [torch.empty_like(k) for k in keys]

    def forward(x: torch.Tensor, start: int) -> torch.Tensor:
        n = x.shape[1]
        positions = torch.arange(start, start + n)[None].expand(rows, n)
        cos, sin = inner.rotary_emb(x, positions)
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(rows, n, -1, head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(rows, n, -1, head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(rows, n, -1, head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[i][:, :, start:start + n] = k
            values[i][:, :, start:start + n] = v
            o = F.scaled_dot_product_attention(q, keys[i][:, :, :start + n], values[i][:, :, :start + n],
                                               is_causal=n > 1, scale=attn.scaling)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(rows, n, -1))
            h = layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
        logits: torch.Tensor = model.lm_head(inner.norm(x[:, -1]))
        return logits.float()

    tokens = prompts.new_empty((rows, new_tokens))
    logprobs = torch.empty((rows, new_tokens))
    with torch.no_grad():
        logits = forward(inner.embed_tokens(prompts), 0)
        for t in range(new_tokens):
            lp = torch.log_softmax(logits, dim=-1)
            token = torch.multinomial(lp.exp(), 1)
            tokens[:, t] = token[:, 0]
            logprobs[:, t] = lp.gather(1, token)[:, 0]
            if t + 1 < new_tokens:
                logits = forward(inner.embed_tokens(token), length + t)
    return tokens, logprobs


def token_logprobs(model: Any, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs ``[B, N]`` of each response token of ``sequences`` ``[B, P + N]``."""
    logits = model(sequences).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(2, sequences[:, prompt_len:, None])[..., 0]


STAGES = ("generate", "reward", "ref", "update")
"""The parts of a floor step, timed."""


class FloorRank:
    """One rank of the floor: its models, optimizer and prompts, set up in this
    process (joining the ranks' gloo group when ``world`` > 1), and :meth:`step`."""

    def __init__(self, rank: int, world: int, port: int, job: E2EJob, threads: int, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from workers.host._allocator import keep_freed_memory
        from workers.host._cpu_policy import run_as_batch

        torch.set_num_threads(threads)
        keep_freed_memory()  # the allocator setting asyncflow's workers run with
        run_as_batch(threads)  # and their scheduling policy
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.manual_seed(job.seed + rank)
        self.job, self.world, self.threads = job, world, threads
        self.policy = AutoModelForCausalLM.from_pretrained(model_dir)
        self.reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.reference.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=job.lr)
        per_rank = job.prompts // world
        self.prompts = job.prompt_ids()[rank * per_rank:(rank + 1) * per_rank].repeat_interleave(job.n, dim=0)
        self.texts: list[str] = self.tokenizer.batch_decode(self.prompts.tolist(), skip_special_tokens=True)
        self.metrics: dict[str, float] = {}

    def step(self) -> list[float]:
        """One GRPO step; the seconds of each of :data:`STAGES`."""
        job = self.job
        clock = [time.perf_counter()]
        responses, old = generate(self.policy, self.prompts, job.new_tokens)
        clock.append(time.perf_counter())
        completions = self.tokenizer.batch_decode(responses.tolist(), skip_special_tokens=True)
        rewards = torch.tensor(digit_reward(self.texts, completions)).view(-1, job.n)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        clock.append(time.perf_counter())
        sequences = torch.cat([self.prompts, responses], dim=1)
        with torch.no_grad():
            ref_lp = token_logprobs(self.reference, sequences, job.prompt_len)
        clock.append(time.perf_counter())
        logprobs = token_logprobs(self.policy, sequences, job.prompt_len)
        ratio = torch.exp(logprobs - old)
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - _CLIP, 1 + _CLIP) * advantages)
        kl = torch.exp(ref_lp - logprobs) - (ref_lp - logprobs) - 1
        loss = (job.kl_coef * kl - surrogate).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.world > 1:
            grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for g, part in zip(grads, flat.div_(self.world).split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.optimizer.step()
        clock.append(time.perf_counter())
        self.metrics = {"loss": loss.item(), "kl_to_ref": kl.mean().item(), "reward/mean": rewards.mean().item()}
        return [end - start for start, end in itertools.pairwise(clock)]

    def close(self) -> None:
        """Leave the ranks' group."""
        if self.world > 1:
            dist.destroy_process_group()


def _rank(rank: int, world: int, port: int, job: E2EJob, steps: int, warmup: int, threads: int,
          model_dir: str, out: Any) -> None:
    """One rank's run; rank 0 puts the record on ``out``."""
    me = FloorRank(rank, world, port, job, threads, model_dir)
    stages: dict[str, list[float]] = {k: [] for k in STAGES}
    times: list[float] = []
    marks = {"ready": time.time() - _START}
    for k in range(warmup + steps):
        parts = me.step()
        times.append(sum(parts))
        if k == 0:
            marks["first_step_done"] = time.time() - _START
        if k >= warmup:
            for name, seconds in zip(STAGES, parts, strict=True):
                stages[name].append(seconds)
    me.close()
    if rank == 0:
        median = statistics.median(times[warmup:])
        out.put({"framework": "floor", "ranks": world, "threads": threads, "s_per_step": median,
                 "tokens_per_s": job.tokens_per_step / median, "steps_s": times, "startup_s": marks,
                 "stage_ms": {k: 1000 * statistics.median(v) for k, v in stages.items()},
                 "last_metrics": me.metrics})


def measure(job: E2EJob, *, ranks: int, steps: int, warmup: int, threads: int | None,
            model_dir: str | None = None) -> dict[str, Any]:
    """Run the workload on ``ranks`` processes, on the model in ``model_dir``
    (default: one this run saves); rank 0's record."""
    if job.prompts % ranks:
        raise ValueError(f"{job.prompts} prompts do not split over {ranks} ranks")
    with job.model_dir(model_dir) as model_dir:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port, per_rank_threads = free_port(), rank_threads(ranks, threads)
        procs = [ctx.Process(target=_rank, args=(r, ranks, port, job, steps, warmup, per_rank_threads, model_dir, out))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        try:
            record: dict[str, Any] = wait_for_ranks(out, procs, timeout_s=600)
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        if any(p.exitcode != 0 for p in procs):
            raise _rank_ended(procs)
    return record


def free_port() -> int:
    """A free port of the loopback interface, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def rank_threads(ranks: int, threads: int | None = None) -> int:
    """Each rank's torch threads: ``threads``, else the cores split over the ranks."""
    return threads or max(1, (os.cpu_count() or 1) // ranks)


def _rank_ended(procs: list[Any]) -> RuntimeError:
    return RuntimeError(f"a floor rank ended: exit codes {[p.exitcode for p in procs]}")


def wait_for_ranks(out: Any, procs: list[Any], *, timeout_s: float) -> Any:
    """The next message on ``out`` (a rank's record or answer); raises as soon as a
    rank ended with an error instead (its peer would wait in the all-reduce), or
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise _rank_ended(procs) from None
    raise TimeoutError(f"the floor's ranks gave no answer within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> None:
    """Run the workload; print its record as JSON on the last line."""
    parser = argparse.ArgumentParser(prog="bench._e2e_floor")
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: the cores split over the ranks)")
    parser.add_argument("--model-dir", help="the workload's model (default: saved by this run)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(E2EJob(), ranks=args.ranks, steps=args.steps, warmup=args.warmup,
                             threads=args.threads, model_dir=args.model_dir)))


if __name__ == "__main__":
    main()
