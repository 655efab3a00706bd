"""Pipeline schedules: 1F1B and interleaved 1F1B against their closed forms, the
simulator's checks, and RLHFuse's fused schedules (valid, never slower than the
greedy baseline, never faster than the lower bound)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from workers.engines import EngineConfigError
from workers.engines.pipeline import (
    PipelineModel,
    Schedule,
    ScheduleError,
    Task,
    backfilled,
    fused_annealed,
    fused_greedy,
    fusion_lower_bound,
    one_f_one_b,
    serial_cost,
    simulate,
)


@pytest.mark.parametrize(("stages", "micro_batches"), list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 5, 8, 13])))
def test_1f1b_takes_its_closed_form_time_and_holds_at_most_p_minus_r(stages: int, micro_batches: int) -> None:
    model = PipelineModel(name="a", stages=stages, micro_batches=micro_batches, forward_s=1.0, backward_s=2.5,
                          activation=3.0)
    sim = simulate(one_f_one_b(model))
    assert sim.finish_s == pytest.approx((micro_batches + stages - 1) * 3.5)
    assert sim.peak_activation == tuple(3.0 * min(micro_batches, stages - r) for r in range(stages))
    assert sim.busy_s == tuple(micro_batches * 3.5 for _ in range(stages))


@pytest.mark.parametrize(("stages", "chunks"), [(2, 2), (4, 2), (4, 4), (3, 3), (8, 2)])
def test_interleaved_1f1b_runs_any_micro_batch_count(stages: int, chunks: int) -> None:
    for micro_batches in range(1, 3 * stages + 2):
        model = PipelineModel(name="a", stages=stages, micro_batches=micro_batches, chunks=chunks,
                              forward_s=1.0 / chunks, backward_s=2.0 / chunks)
        schedule = one_f_one_b(model)
        sim = simulate(schedule)  # raises if a device misses a pass or the orders deadlock
        assert sum(map(len, schedule.orders)) == 2 * micro_batches * stages * chunks
        if micro_batches % stages == 0:
            # Megatron's virtual pipeline: the fill and drain shrink by the chunk count.
            assert sim.finish_s == pytest.approx(micro_batches * 3.0 + (stages - 1) * 3.0 / chunks)
        plain = simulate(one_f_one_b(dataclasses.replace(model, chunks=1, forward_s=1.0, backward_s=2.0)))
        assert sim.finish_s <= plain.finish_s + 1e-9


def test_reversed_and_side_by_side_pipelines_sit_where_they_say() -> None:
    model = PipelineModel(name="b", stages=2, pipelines=2, micro_batches=3, reverse=True)
    schedule = one_f_one_b(model)
    assert [model.device_of(j, s) for j in (0, 1) for s in (0, 1)] == [3, 2, 1, 0]
    assert {t.pipeline for t in schedule.orders[3]} == {0} and {t.stage for t in schedule.orders[3]} == {0}
    assert simulate(schedule).finish_s == pytest.approx((3 + 1) * 3.0)


def _model() -> PipelineModel:
    return PipelineModel(name="a", stages=2, micro_batches=2)


def test_simulate_rejects_a_deadlock_naming_the_orders() -> None:
    models = one_f_one_b(_model()).models
    f0, f1 = Task(0, 0, 0, 0, False), Task(0, 0, 1, 0, False)
    b0, b1 = Task(0, 0, 0, 0, True), Task(0, 0, 1, 0, True)
    last = [t._replace(stage=1) for t in (f0, f1, b0, b1)]
    # Device 0 runs micro-batch 1's forward only after micro-batch 0's backward, which
    # waits for device 1's; device 1 runs that only after micro-batch 1's forward.
    with pytest.raises(ScheduleError, match="deadlocks") as raised:
        simulate(Schedule(models, ((f0, b0, f1, b1), (last[1], last[3], last[0], last[2]))))
    assert "Fa0 Ba0 Fa1 Ba1" in str(raised.value)
    # A backward before its own forward on the last stage.
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(Schedule(models, ((f0, f1, b0, b1), (last[2], last[0], last[1], last[3]))))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda o: (o[0][1:], o[1]), "no device runs"),
        (lambda o: (o[0] + o[0][:1], o[1]), "comes twice"),
        (lambda o: (o[0] + o[1][:1], o[1][1:]), "belongs on device 1"),
        (lambda o: (o[0] + (Task(0, 0, 9, 0, False),), o[1]), "is not a pass"),
        (lambda o: (o[0],), "1 devices"),
    ],
)
def test_simulate_rejects_a_schedule_that_misses_repeats_or_misplaces_a_pass(edit, message: str) -> None:
    good = one_f_one_b(_model())
    with pytest.raises(ScheduleError, match=message):
        simulate(Schedule(good.models, edit(good.orders)))


def test_models_are_validated() -> None:
    with pytest.raises(EngineConfigError, match="stages"):
        PipelineModel(name="a", stages=0, micro_batches=1)
    with pytest.raises(EngineConfigError, match="backward_s"):
        PipelineModel(name="a", stages=1, micro_batches=1, backward_s=-1.0)
    with pytest.raises(EngineConfigError, match="same devices"):
        fused_greedy([PipelineModel(name="a", stages=4, micro_batches=4),
                      PipelineModel(name="b", stages=2, micro_batches=4, reverse=True)])


def _pair(p0: int, p1: int, micro_batches: int, *, ratio: float = 0.5) -> list[PipelineModel]:
    """An actor over ``p0`` stages and a critic ``ratio`` its size over ``p1`` stages,
    ``p0 // p1`` critic pipelines running the other way."""
    k = p0 // p1
    return [
        PipelineModel(name="actor", stages=p0, micro_batches=micro_batches, forward_s=1.0 / p0,
                      backward_s=2.0 / p0, activation=1.0 / p0),
        PipelineModel(name="critic", stages=p1, pipelines=k, micro_batches=micro_batches // k,
                      forward_s=ratio / p1, backward_s=2 * ratio / p1, activation=ratio / p1, reverse=True),
    ]


SETTINGS = [(2, 2, 4), (4, 4, 4), (4, 4, 8), (4, 2, 8), (8, 4, 8)]


@pytest.mark.parametrize(("p0", "p1", "micro_batches"), SETTINGS)
def test_fused_schedules_run_every_pass_and_respect_the_bound(p0: int, p1: int, micro_batches: int) -> None:
    models = _pair(p0, p1, micro_batches)
    bound = fusion_lower_bound(models)
    serial = serial_cost(models)
    greedy = simulate(fused_greedy(models))
    annealed_schedule = fused_annealed(models, iterations=300, seed=1)
    annealed = simulate(annealed_schedule)
    passes = sum(2 * m.pipelines * m.micro_batches * m.virtual_stages for m in models)
    assert sum(map(len, annealed_schedule.orders)) == passes
    for sim in (greedy, annealed):
        assert bound <= sim.finish_s + 1e-9
        assert sim.finish_s < serial.finish_s  # the critic fills the actor's bubbles
    assert annealed.finish_s <= greedy.finish_s + 1e-9
    # Each model alone: the bound is its 1F1B time, which no schedule beats.
    for model in models:
        alone = dataclasses.replace(model, reverse=False)
        assert fusion_lower_bound([alone]) == pytest.approx(simulate(one_f_one_b(alone)).finish_s)


def test_the_annealed_schedule_reaches_the_bound_where_the_critic_fits_in_the_bubbles() -> None:
    models = _pair(4, 4, 4, ratio=0.4)
    annealed = simulate(fused_annealed(models, iterations=500))
    assert annealed.finish_s == pytest.approx(fusion_lower_bound(models))
    assert annealed.finish_s == pytest.approx(simulate(one_f_one_b(models[0])).finish_s)


@pytest.mark.parametrize(("p0", "p1"), [(4, 4), (4, 2), (8, 8)])
def test_late_backfilling_reaches_the_bound_within_the_serial_peak(p0: int, p1: int) -> None:
    # The actor's first stages start their forwards only as late as the pipeline
    # needs them: the critic's passes run there while the actor holds fewer
    # activations. Started when they can, the actor's forwards leave the critic
    # waiting for the cool-down.
    models = _pair(p0, p1, p0, ratio=0.5)
    serial, bound = serial_cost(models), fusion_lower_bound(models)
    assert bound == pytest.approx(simulate(one_f_one_b(models[0])).finish_s)
    late = backfilled(models, memory_limit=serial.peak)
    eager = backfilled(models, memory_limit=serial.peak, late=False)
    assert late is not None and eager is not None
    assert simulate(late).finish_s == pytest.approx(bound)
    assert simulate(late).peak <= serial.peak + 1e-9
    assert simulate(eager).finish_s > bound * 1.1
    annealed = simulate(fused_annealed(models, iterations=200))
    assert annealed.finish_s == pytest.approx(bound)
    assert annealed.peak <= serial.peak + 1e-9


def test_a_backbone_allowed_to_finish_at_the_bound_leaves_the_other_model_room() -> None:
    # Here the devices' work adds up to more than the actor's 1F1B takes, so no
    # schedule finishes before the bound and the actor may as well finish there.
    # Started at their latest for the actor's own finish, its passes leave the
    # critic too little room within the serial peak.
    models = _pair(4, 4, 8)
    serial, bound = serial_cost(models), fusion_lower_bound(models)
    own = simulate(one_f_one_b(models[0])).finish_s
    assert bound > own
    tight = backfilled(models, memory_limit=serial.peak)
    assert tight is not None
    assert simulate(tight).finish_s > bound * 1.05
    _reaches_the_bound_within_the_serial_peak(models, backfilled(models, memory_limit=serial.peak,
                                                                 late_by_s=bound - own))


def test_a_delay_grown_along_the_backbone_reaches_the_bound_where_one_moved_at_once_does_not() -> None:
    # The actor may finish at the bound here too, but moved later all at once its
    # first micro-batch's forwards give the critic room where it cannot use it
    # within serial 1F1B's peak, and the critic's passes then hold the actor's
    # steady state back. Grown along the actor's schedule, the delay leaves those
    # forwards on time and gives the critic its room where the actor has it.
    models = _pair(8, 4, 16)
    serial, bound = serial_cost(models), fusion_lower_bound(models)
    gap = bound - simulate(one_f_one_b(models[0])).finish_s
    assert gap > 0
    at_once = [backfilled(models, memory_limit=serial.peak, late_by_s=k * gap) for k in (0.5, 1.0, 1.5, 2.0)]
    assert min(simulate(s).finish_s for s in at_once if s is not None) > bound * 1.02
    _reaches_the_bound_within_the_serial_peak(models, backfilled(models, memory_limit=serial.peak,
                                                                 late_by_s=1.5 * gap, ramp=4.0))


def test_an_anticipated_backbone_pass_keeps_the_other_model_out_of_its_way() -> None:
    # Here, on a device whose next actor pass has its input still unplaced, the
    # critic's passes run as long as they like and hold the actor back when that
    # input arrives: at best 13% past the bound within serial 1F1B's peak. Due at
    # its latest start all the same, the actor's pass keeps them out of its way.
    models = _pair(8, 4, 8)
    serial, bound = serial_cost(models), fusion_lower_bound(models)
    plain = [backfilled(models, memory_limit=serial.peak, slack_s=k * models[0].forward_s) for k in (0, 0.25, 0.5, 1)]
    assert min(simulate(s).finish_s for s in plain if s is not None) > bound * 1.1
    _reaches_the_bound_within_the_serial_peak(models, backfilled(models, memory_limit=serial.peak, anticipate=True))


def _reaches_the_bound_within_the_serial_peak(models: list[PipelineModel], schedule: Schedule | None) -> None:
    """``schedule``, and the annealed search under serial 1F1B's peak, finish at the
    lower bound; ``schedule`` holds no more than that peak."""
    serial, bound = serial_cost(models), fusion_lower_bound(models)
    assert schedule is not None
    assert simulate(schedule).finish_s == pytest.approx(bound)
    assert simulate(schedule).peak <= serial.peak + 1e-9
    annealed = simulate(fused_annealed(models, iterations=200, memory_limit=serial.peak))
    assert annealed.finish_s == pytest.approx(bound)


@pytest.mark.parametrize(("p0", "p1"), [(4, 2), (8, 4)])
def test_bounded_backfilling_keeps_the_other_models_1f1b_bound(p0: int, p1: int) -> None:
    models = _pair(p0, p1, 2 * p0)
    schedule = backfilled(models, bounded=True)
    assert schedule is not None
    assert simulate(schedule).finish_s < serial_cost(models).finish_s
    most = 0
    for order in schedule.orders:
        held: dict[tuple[int, int], int] = {}
        for task in order:
            if task.model == 1:  # the critic, not the backbone
                lane = (task.pipeline, task.stage)
                held[lane] = held.get(lane, 0) + (-1 if task.backward else 1)
                assert held[lane] <= p1 - task.stage, schedule.describe()
                most = max(most, held[lane])
    assert most == p1  # the bound is reached, not just respected
    unbounded = backfilled(models)
    assert unbounded is not None and unbounded != schedule


def test_the_tolerance_trades_finish_time_for_held_activations() -> None:
    # Here the fastest schedule found holds 1.25 times serial 1F1B's peak; one 2.7%
    # slower holds no more than it.
    models = _pair(4, 2, 16)
    fastest = simulate(fused_annealed(models, iterations=300, tolerance=0.0))
    assert fastest.finish_s <= simulate(fused_greedy(models)).finish_s + 1e-9
    lean = simulate(fused_annealed(models, iterations=300, tolerance=0.1))
    assert fastest.finish_s < lean.finish_s <= fastest.finish_s * 1.1 + 1e-9
    assert lean.peak < fastest.peak


def test_the_search_is_deterministic_given_its_seed() -> None:
    models = _pair(4, 2, 8)
    assert fused_annealed(models, iterations=200, seed=3) == fused_annealed(models, iterations=200, seed=3)


def test_memory_limits_hold() -> None:
    models = _pair(4, 4, 8)
    peak = serial_cost(models).peak
    for factor in (1.0, 1.25):
        schedule = backfilled(models, memory_limit=peak * factor)
        assert schedule is not None
        assert simulate(schedule).peak <= peak * factor + 1e-9
        limited = simulate(fused_annealed(models, iterations=300, memory_limit=peak * factor))
        assert limited.peak <= peak * factor + 1e-9
    with pytest.raises(ScheduleError, match="memory_limit"):
        fused_annealed(models, iterations=10, memory_limit=peak * 0.1)
