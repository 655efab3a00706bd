"""The placement planner on hand-built traces and workloads: the simulator's
scheduling rules, the cost model's fit, and the enumeration of placements."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence

import pytest

from asyncflow.plan import (
    CostModel,
    CostSample,
    MissingCostError,
    Placement,
    Prediction,
    Profile,
    SimSpan,
    StreamPart,
    WorkCall,
    Workload,
    candidates,
    fit_interference,
    fit_oversubscription,
    oversubscribed,
    rank,
    rank_profiled,
    simulate,
)
from asyncflow.tracing._records import CallRecord, RankSpan, Trace


def work(*calls: WorkCall) -> Workload:
    return Workload(calls=calls)


def call(i: int, role: str, *, rank_local: bool = False, rows: int = 2, deps: Sequence[int] = (),
         parts: Sequence[StreamPart] = (), release: Sequence[float] = ()) -> WorkCall:
    return WorkCall(index=i, role=role, method="f", rank_local=rank_local, rows_in=rows,
                    deps=tuple(deps), parts=tuple(parts), release=tuple(release))


def costs(**seconds: float) -> CostModel:
    """Constant costs: ``role_d=seconds`` means ``role.f`` on ``d`` ranks takes ``seconds``."""
    samples = []
    for key, s in seconds.items():
        role, d = key.rsplit("_", 1)
        samples.append(CostSample(role, "f", int(d), 1.0, s))
    return CostModel(samples)


def place(**pools: tuple[int, str]) -> Placement:
    """``name=(devices, "role role ...")``."""
    return Placement(pools={n: d for n, (d, _) in pools.items()},
                     roles={r: n for n, (_, rs) in pools.items() for r in rs.split()})


def span(pred: Prediction, label: str) -> SimSpan:
    (found,) = [s for s in pred.spans if s.label == label]
    return found


# ----- scheduling rules -----


def test_calls_on_two_pools_overlap_and_on_one_pool_serialise() -> None:
    w, c = work(call(0, "a"), call(1, "b")), costs(a_1=2.0, b_1=3.0)
    apart = simulate(w, c, place(pa=(1, "a"), pb=(1, "b")), steps=3)
    together = simulate(w, c, place(p=(1, "a b")), steps=3)
    assert apart.step_s == pytest.approx(3.0)
    assert apart.total_s == pytest.approx(9.0)
    assert together.step_s == pytest.approx(5.0)
    assert together.busy_s == {"p": pytest.approx(15.0)}


def test_gang_call_waits_for_a_running_rank_local_call() -> None:
    w = work(call(0, "x", rank_local=True), call(1, "g"))
    pred = simulate(w, costs(x_2=2.0, g_2=1.0), place(p=(2, "x g")), steps=1)
    assert span(pred, "x.f#0").ranks == (0, 1)
    assert span(pred, "g.f#1").start == pytest.approx(2.0)
    assert pred.step_s == pytest.approx(3.0)


def test_gang_call_waits_behind_an_earlier_waiting_call_on_an_idle_pool() -> None:
    # lp waits for its input from the other pool; the gang call behind it may not pass.
    w = work(call(0, "src"), call(1, "lp", rank_local=True, deps=[0]), call(2, "g"))
    pred = simulate(w, costs(src_1=2.0, lp_2=1.0, g_2=1.0), place(a=(1, "src"), b=(2, "lp g")),
                    steps=1)
    assert span(pred, "lp.f#1").start == pytest.approx(2.0)
    assert span(pred, "g.f#2").start == pytest.approx(3.0)


def test_rank_local_calls_run_side_by_side_on_the_free_ranks() -> None:
    # gen streams: rank 0 is given back halfway, when micro-batch 1 is out.
    w = work(call(0, "gen", rank_local=True, release=[0.5, 1.0]),
             call(1, "lp", rank_local=True, parts=[StreamPart(0, 1, 0.5)]),
             call(2, "lp", rank_local=True, parts=[StreamPart(0, 2, 1.0)]))
    pred = simulate(w, costs(gen_2=4.0, lp_1=1.0), place(p=(2, "gen lp")), steps=1, migrate=True)
    first = span(pred, "lp.f#1")
    assert (first.ranks, first.start, first.end) == ((0,), pytest.approx(2.0), pytest.approx(3.0))
    assert span(pred, "gen.f#0").end == pytest.approx(4.0)  # still running on rank 1
    second = span(pred, "lp.f#2")  # both ranks free again: rows split, half the time
    assert (second.ranks, second.start, second.end) == ((0, 1), pytest.approx(4.0),
                                                        pytest.approx(4.5))
    assert pred.busy_s["p"] == pytest.approx((4.0 + 2.0 + 1.0 + 2 * 0.5) / 2)


def test_rank_local_call_passes_a_waiting_gang_call_only_while_a_gang_call_runs() -> None:
    part = StreamPart(0, 1, 0.5)
    w = work(call(0, "gen", release=[0.5, 1.0]), call(1, "upd"),
             call(2, "lp", rank_local=True, parts=[part]))
    c = costs(gen_2=4.0, upd_2=1.0, lp_1=1.0, lp_2=1.0)
    pred = simulate(w, c, place(p=(2, "gen upd lp")), steps=1, migrate=True)
    assert span(pred, "lp.f#2").start == pytest.approx(2.0)  # gang gen holds rank 1
    assert span(pred, "upd.f#1").start == pytest.approx(4.0)
    # Same calls with a rank-local gen: no gang call runs, so lp may not pass upd.
    w = work(call(0, "gen", rank_local=True, release=[0.5, 1.0]), call(1, "upd"),
             call(2, "lp", rank_local=True, parts=[part]))
    pred = simulate(w, c, place(p=(2, "gen upd lp")), steps=1, migrate=True)
    assert span(pred, "upd.f#1").start == pytest.approx(4.0)
    assert span(pred, "lp.f#2").start == pytest.approx(5.0)


def test_calls_on_a_stream_from_their_own_pool_become_one_call_on_the_whole_batch() -> None:
    # gen streams two micro-batches; lp (gen's pool) and v (another pool) read both;
    # upd reads every lp and v call.
    w = work(call(0, "gen", release=[1.0]),
             call(1, "lp", rank_local=True, parts=[StreamPart(0, 1, 0.5)]),
             call(2, "v", rank_local=True, parts=[StreamPart(0, 1, 0.5)]),
             call(3, "lp", rank_local=True, parts=[StreamPart(0, 2, 1.0)]),
             call(4, "v", rank_local=True, parts=[StreamPart(0, 2, 1.0)]),
             call(5, "upd", deps=[1, 2, 3, 4]))
    pools = place(a=(2, "gen lp upd"), b=(1, "v"))
    got = w.on_placement(pools.roles, pools.pools)
    assert [(c.label, c.rows_in, c.deps, len(c.parts)) for c in got.calls] == [
        ("gen.f#0", 2, (), 0), ("lp.f#1", 4, (0,), 0), ("v.f#2", 2, (), 1), ("v.f#3", 2, (), 1),
        ("upd.f#4", 2, (1, 2, 3), 0)]
    assert [p.call for c in got.calls for p in c.parts] == [0, 0]
    # With migration, rank-local calls on a pool of several ranks stay per micro-batch.
    assert w.on_placement(pools.roles, pools.pools, migrate=True) == w
    apart = place(a=(1, "gen"), b=(1, "lp v upd"))
    assert w.on_placement(apart.roles, apart.pools) == w
    c = costs(gen_2=4.0, lp_2=1.0, v_1=1.0, upd_2=1.0)
    pred = simulate(w, c, pools, steps=1)
    assert span(pred, "lp.f#1").start == pytest.approx(4.0)
    assert pred.step_s == pytest.approx(4.0 + 1.0 + 1.0)


def test_rank_local_call_never_passes_a_waiting_call_of_its_own_role() -> None:
    w = work(call(0, "src"), call(1, "lp", rank_local=True, deps=[0]), call(2, "lp", rank_local=True),
             call(3, "other", rank_local=True))
    c = costs(src_1=2.0, lp_2=1.0, other_2=1.0)
    pred = simulate(w, c, place(a=(1, "src"), b=(2, "lp other")), steps=1)
    assert span(pred, "other.f#3").start == pytest.approx(0.0)  # another role passes lp#1
    assert span(pred, "lp.f#1").start == pytest.approx(2.0)
    assert span(pred, "lp.f#2").start == pytest.approx(3.0)


def test_step_barrier_and_driver_overhead() -> None:
    w, c = work(call(0, "a"), call(1, "b")), costs(a_1=1.0, b_1=3.0)
    pred = simulate(w, c, place(pa=(1, "a"), pb=(1, "b")), steps=2, step_overhead_s=0.5)
    assert span(pred, "a.f#0").start == pytest.approx(0.5)
    assert span(pred, "a.f#2").start == pytest.approx(4.0)  # after b of step 0, + overhead
    assert pred.steps_s == (pytest.approx(3.5), pytest.approx(3.5))
    assert pred.step_s == pytest.approx(3.5)


def test_cpu_contention_shares_the_cores() -> None:
    w = work(*(call(i, f"r{i}") for i in range(4)))
    c = costs(r0_1=1.0, r1_1=1.0, r2_1=1.0, r3_1=1.0)
    standalone = place(p0=(1, "r0"), p1=(1, "r1"), p2=(1, "r2"), p3=(1, "r3"))
    assert simulate(w, c, standalone, steps=1, cores=2).step_s == pytest.approx(2.0)
    assert simulate(w, c, standalone, steps=1, cores=4).step_s == pytest.approx(1.0)
    assert simulate(w, c, standalone, steps=1).step_s == pytest.approx(1.0)


def test_cpu_contention_rate_changes_when_a_call_ends() -> None:
    w, c = work(call(0, "a"), call(1, "b")), costs(a_1=1.0, b_1=3.0)
    pred = simulate(w, c, place(pa=(1, "a"), pb=(1, "b")), steps=1, cores=1)
    assert span(pred, "a.f#0").end == pytest.approx(2.0)  # half speed while b runs
    assert span(pred, "b.f#1").end == pytest.approx(4.0)  # 1 s done by then, 2 s alone


def test_calls_side_by_side_slow_each_other_by_the_interference() -> None:
    w, c = work(call(0, "a"), call(1, "b")), costs(a_1=1.0, b_1=3.0)
    pred = simulate(w, c, place(pa=(1, "a"), pb=(1, "b")), steps=1, cores=2, interference=0.5)
    assert span(pred, "a.f#0").end == pytest.approx(1.5)  # the other call takes 1 core: rate 1 / 1.5
    assert span(pred, "b.f#1").end == pytest.approx(3.5)  # 1 s of work done by then, 2 s alone
    # Without cores (GPUs) nothing is shared; a call alone is never slowed, whatever its ranks.
    assert simulate(w, c, place(pa=(1, "a"), pb=(1, "b")), steps=1, interference=0.5).step_s == pytest.approx(3.0)
    gang = simulate(work(call(0, "a")), costs(a_2=1.0), place(p=(2, "a")), steps=1, cores=2, interference=0.5)
    assert gang.step_s == pytest.approx(1.0)


def test_interference_adds_to_sharing_the_cores() -> None:
    w = work(*(call(i, f"r{i}") for i in range(4)))
    c = costs(r0_1=1.0, r1_1=1.0, r2_1=1.0, r3_1=1.0)
    standalone = place(p0=(1, "r0"), p1=(1, "r1"), p2=(1, "r2"), p3=(1, "r3"))
    # Half a core each, and the other three calls take 2 * 3/4 of the busy cores.
    pred = simulate(w, c, standalone, steps=1, cores=2, interference=0.5)
    assert pred.step_s == pytest.approx(2.0 * (1 + 0.5 * 1.5))
    with pytest.raises(ValueError, match="interference"):
        simulate(w, c, standalone, steps=1, cores=2, interference=-0.1)


def test_fit_interference_finds_the_slowdown_of_the_timed_overlapped_steps() -> None:
    w, c = work(call(0, "a"), call(1, "b")), costs(a_1=1.0, b_1=1.0)
    pair = place(pa=(1, "a"), pb=(1, "b"))
    found = Profile(costs=c, batch=w, stream=None, overlapped_s={"batch": 1.3})
    assert fit_interference(found, pair, cores=2) == pytest.approx(0.3)  # two calls side by side: 1 + a
    found.interference = 0.3
    one_pool = place(p=(1, "a b"))  # one after the other: 2 s, whatever the interference
    ranked = rank_profiled(found, [one_pool, pair], cores=2)
    assert [p for p, _ in ranked] == [pair, one_pool] and ranked[0][1].step_s == pytest.approx(1.3)
    assert fit_interference(Profile(costs=c, batch=w, stream=None), pair, cores=2) == 0.0


def test_more_processes_than_cores_slow_every_call_even_one_at_a_time() -> None:
    w = work(*(call(i, f"r{i}", deps=[i - 1] if i else []) for i in range(4)))  # a chain: one at a time
    c = costs(r0_1=1.0, r1_1=1.0, r2_1=1.0, r3_1=1.0)
    standalone = place(p0=(1, "r0"), p1=(1, "r1"), p2=(1, "r2"), p3=(1, "r3"))
    split = place(pa=(1, "r0 r1"), pb=(1, "r2 r3"))
    assert oversubscribed(4, 2, 0.2) == pytest.approx(1.2) and oversubscribed(2, 2, 0.2) == 1.0
    assert simulate(w, c, standalone, steps=1, cores=2, oversubscription=0.2).step_s == pytest.approx(4.8)
    assert simulate(w, c, split, steps=1, cores=2, oversubscription=0.2).step_s == pytest.approx(4.0)
    assert simulate(w, c, standalone, steps=1, oversubscription=0.2).step_s == pytest.approx(4.0)  # GPUs
    with pytest.raises(ValueError, match="oversubscription"):
        simulate(w, c, standalone, steps=1, cores=2, oversubscription=-0.1)


def test_fit_oversubscription_compares_the_same_serial_calls_on_more_and_fewer_processes() -> None:
    crowded = Trace(calls=[record(1, "a", "a", 0.0, 1.2), record(2, "b", "b", 1.2, 2.4),
                           record(3, "c", "c", 2.4, 3.0, ok=False)])  # a failed call does not count
    packed = Trace(calls=[record(1, "a", "core0", 0.0, 1.0), record(2, "b", "core1", 1.0, 2.0),
                          record(3, "c", "core0", 2.0, 2.1, ok=False)])
    # 4 processes on 2 cores took 1.2x: 1 + s * (4 - 2) / 2.
    assert fit_oversubscription(crowded, packed, 4, cores=2) == pytest.approx(0.2)
    assert fit_oversubscription(packed, crowded, 4, cores=2) == 0.0  # faster when crowded: noise
    assert fit_oversubscription(crowded, packed, 2, cores=2) == 0.0  # no more processes than cores


def test_a_call_waiting_for_one_queued_behind_it_is_reported() -> None:
    w = work(call(0, "a", deps=[1]), call(1, "b"))
    with pytest.raises(ValueError, match=r"a\.f#0 on p"):
        simulate(w, costs(a_1=1.0, b_1=1.0), place(p=(1, "a b")), steps=1)


def test_simulate_rejects_a_placement_missing_a_role() -> None:
    with pytest.raises(ValueError, match=r"no pool to \['b'\]"):
        simulate(work(call(0, "a"), call(1, "b")), costs(a_1=1.0, b_1=1.0), place(p=(1, "a")))


# ----- from a trace -----


def record(call_id: int, role: str, pool: str, started: float, finished: float, *, step: int = 0,
           rows_in: Sequence[int] = (4,), ok: bool = True, deps: Sequence[int] = (),
           parts: Sequence[tuple[int, int]] = (), part_times: Sequence[float] = (),
           rank_local: bool = False) -> CallRecord:
    spans = tuple(RankSpan(pool=pool, rank=r, worker=r, start=started, end=finished, rows=0,
                           rows_in=n, bytes_pulled=0) for r, n in enumerate(rows_in))
    return CallRecord(call_id=call_id, role=role, method="f", pool=pool, rank_local=rank_local,
                      deps=tuple(deps), parts=tuple(parts), step=step, submitted=started,
                      started=started, finished=finished, ok=ok, ranks=spans,
                      part_times=tuple(part_times))


def test_streamed_consumer_starts_at_the_parts_fraction() -> None:
    trace = Trace(calls=[
        record(1, "gen", "a", 10.0, 14.0, part_times=(11.0, 12.0, 14.0)),
        record(2, "lp", "b", 11.0, 11.5, parts=[(1, 1)]),
        record(3, "lp", "b", 12.0, 12.5, parts=[(1, 2)]),
    ], pools={"a": 1, "b": 1}, roles={"gen": "a", "lp": "b"})
    w = Workload.from_trace(trace)
    assert w.calls[1].parts == (StreamPart(0, 1, 0.25),)
    pred = simulate(w, CostModel.from_traces(trace), place(a=(1, "gen"), b=(1, "lp")), steps=1)
    assert span(pred, "lp.f#1").start == pytest.approx(1.0)
    assert span(pred, "lp.f#2").start == pytest.approx(2.0)
    assert pred.step_s == pytest.approx(4.0)


def test_workload_takes_the_last_complete_step_and_drops_other_steps_deps() -> None:
    trace = Trace(calls=[
        record(1, "a", "p", 0.0, 1.0, step=0),
        record(2, "a", "p", 1.0, 2.0, step=1),
        record(3, "b", "p", 2.0, 3.0, step=1, deps=[1, 2], rows_in=(3, 5)),
        record(4, "a", "p", 3.0, 4.0, step=2),
        record(5, "a", "p", 4.0, 5.0, step=2, ok=False),  # step 2 is not complete
        record(6, "a", "p", 5.0, 6.0, step=3),  # the last step: tracing may have cut it short
    ])
    w = Workload.from_trace(trace)
    assert [(c.index, c.role, c.deps, c.rows_in) for c in w.calls] == [(0, "a", (), 4),
                                                                      (1, "b", (0,), 8)]
    assert [c.role for c in Workload.from_trace(trace, step=0).calls] == ["a"]
    with pytest.raises(ValueError, match=r"step 2 has failed calls \(a\.f#5\)"):
        Workload.from_trace(trace, step=2)
    with pytest.raises(ValueError, match="no calls in step 7"):
        Workload.from_trace(trace, step=7)
    repeated = w.repeat(2)
    assert [(c.index, c.step, c.deps) for c in repeated.calls][2:] == [(2, 1, ()), (3, 1, (2,))]


# ----- costs -----


def test_cost_model_recovers_a_line_and_scales_to_unmeasured_ranks() -> None:
    a, b = 0.5, 0.01
    samples = [CostSample("actor", "update", 2, x, a + b * x) for x in (100.0, 200.0, 400.0)]
    samples.append(CostSample("actor", "update", 1, 50.0, 9.0))
    model = CostModel(samples)
    assert model.fit("actor", "update", 2) == (pytest.approx(a), pytest.approx(b))
    assert model.predict("actor", "update", 2, 600) == pytest.approx(a + b * 300)
    # 4 ranks never measured: from 2 ranks, time proportional to rows per rank.
    assert model.predict("actor", "update", 4, 600) == pytest.approx((a + b * 300) * 2 / 4)
    assert model.predict("actor", "update", 1, 10) == pytest.approx(9.0)  # one rows value: constant


def test_cost_model_keeps_coefficients_non_negative() -> None:
    falling = [CostSample("r", "f", 1, x, 5.0 - x) for x in (1.0, 2.0, 3.0)]
    assert CostModel(falling).fit("r", "f", 1) == (pytest.approx(3.0), 0.0)
    steep = [CostSample("r", "f", 1, x, 2.0 * x - 1.0) for x in (1.0, 2.0, 3.0)]
    # Through the origin: b = sum(x y) / sum(x x) = (1 + 6 + 15) / 14.
    assert CostModel(steep).fit("r", "f", 1) == (0.0, pytest.approx(22 / 14))


def test_cost_model_from_a_trace_and_unknown_methods() -> None:
    trace = Trace(calls=[record(1, "gen", "a", 0.0, 2.0, rows_in=(3, 5)),
                         record(2, "gen", "a", 5.0, 9.0, ok=False)])
    model = CostModel.from_traces(trace)
    assert model.samples == [CostSample("gen", "f", 2, 4.0, 2.0)]
    with pytest.raises(MissingCostError, match=r"no measured call of gen\.g") as err:
        model.predict("gen", "g", 1, 4)
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)


# ----- placements -----


def test_candidates_count_for_four_roles_on_two_devices() -> None:
    roles = ["actor", "ref", "critic", "reward"]
    gpu = candidates(roles, 2)
    # 1 pool: 1 partition x 1 split (2); 2 pools: S(4,2) = 7 partitions x 1 split (1+1).
    assert len(gpu) == 1 + 7
    # On CPU also 3 pools (S(4,3) = 6) and 4 pools (1), one slot each.
    cpu = candidates(roles, 2, cores=2)
    assert len(cpu) == 1 + 7 + 6 + 1
    assert len(set(cpu)) == len(cpu)
    assert [p for p in cpu if len(p.pools) <= 2] == gpu
    assert all(set(p.pools.values()) == {1} for p in cpu if len(p.pools) > 2)
    assert all(sorted(p.roles) == sorted(roles) for p in cpu)
    # 3 devices on GPUs: 1 + 7 partitions x 2 splits (1+2, 2+1) + 6 x 1.
    assert len(candidates(roles, 3)) == 1 + 14 + 6
    assert len(candidates(roles, 2, cores=2, max_pools=2)) == 8
    assert candidates(roles, 2)[0].pools == {"actor_ref_critic_reward": 2}


def test_placement_describe_and_config_block() -> None:
    p = place(actor_ref=(1, "actor ref"), critic_reward=(1, "critic reward"))
    assert p.describe() == "actor+ref | critic+reward (1+1 devices)"
    parsed = tomllib.loads(p.config_block())
    assert parsed["pools"] == {"actor_ref": {"devices": 1}, "critic_reward": {"devices": 1}}
    assert parsed["placement"] == {"actor": {"pool": "actor_ref"}, "ref": {"pool": "actor_ref"},
                                   "critic": {"pool": "critic_reward"},
                                   "reward": {"pool": "critic_reward"}}
    odd = Placement(pools={"main pool": 2}, roles={"a.b": "main pool"})
    assert tomllib.loads(odd.config_block())["placement"] == {"a.b": {"pool": "main pool"}}
    with pytest.raises(ValueError, match="not in pools"):
        Placement(pools={"p": 1}, roles={"a": "q"})


def test_rank_puts_the_faster_placement_first() -> None:
    w, c = work(call(0, "a"), call(1, "b")), costs(a_1=2.0, b_1=2.0, a_2=1.5, b_2=1.5)
    ranked = rank(w, c, candidates(w.roles, 2), steps=2)
    assert [p.describe() for p, _ in ranked] == ["a | b (1+1 devices)", "a+b (2 devices)"]
    assert [pred.step_s for _, pred in ranked] == [pytest.approx(2.0), pytest.approx(3.0)]
