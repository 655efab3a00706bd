"""Typed role groups: mypy (with ``asyncflow.mypy_plugin``) checks calls through a
``RoleGroup[W]`` against ``W``'s registered methods, and at run time a wrong method
or argument fails at call time with the role's registered methods in the message.

The mypy test type-checks the fixtures in ``tests/typing/`` with the project's
configuration and cache (``.mypy_cache``, warm after ``make test``'s own mypy run).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from asyncflow import DataFuture, DataStream, ResourcePool, RoleSpec, Stage, StreamOptions, collect
from asyncflow.algos import Feed
from asyncflow.runtime import CallArgumentError
from support import Consumer, Producer, Ticker, run_local
from workers import endpoints
from workers.roles import ActorWorker

ROOT = Path(__file__).resolve().parents[2]
OK = "tests/typing/typed_algo_ok.py"
BAD = "tests/typing/typed_algo_bad.py"
ACTOR_METHODS = ", ".join(sorted(endpoints(ActorWorker)))  # what the run time finds


def _marked_lines(path: str, marker: str) -> list[int]:
    lines = (ROOT / path).read_text().splitlines()
    return [i for i, line in enumerate(lines, 1) if f"# error: {marker}" in line]


@pytest.fixture(scope="module")
def mypy_output() -> dict[str, list[str]]:
    """mypy's error lines for each fixture (one run over both)."""
    api = pytest.importorskip("mypy.api")  # GPU machines may run the suite without the dev tools
    stdout, stderr, _ = api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"),
        "--no-error-summary", "--hide-error-context", "--no-pretty", "--show-error-codes",
        str(ROOT / OK), str(ROOT / BAD),
    ])
    assert not stderr, stderr
    out: dict[str, list[str]] = {OK: [], BAD: []}
    for line in stdout.splitlines():
        path = Path(line.split(":", 1)[0]).resolve()
        key = next((k for k in out if path == ROOT / k), None)
        assert key is not None, f"mypy reported outside the fixtures: {line}"
        if ": note: " not in line:
            out[key].append(line.split(":", 1)[1])
    return out


def test_a_typed_algorithm_type_checks_clean(mypy_output: dict[str, list[str]]) -> None:
    assert mypy_output[OK] == []


def test_mypy_reports_a_misspelt_method_an_unknown_keyword_and_a_bad_timeout(
        mypy_output: dict[str, list[str]]) -> None:
    [method_line] = _marked_lines(BAD, "misspelt method")
    [keyword_line] = _marked_lines(BAD, "unknown keyword")
    [timeout_line] = _marked_lines(BAD, "timeout_s is seconds")
    assert mypy_output[BAD] == [
        f'{method_line}: error: "generat" of role class "ActorWorker" is not a registered method '
        f'(did you mean "generate"?); its registered methods are: {ACTOR_METHODS}  [attr-defined]',
        f'{keyword_line}: error: Unexpected keyword argument "nn" for "generate" of "ActorWorker"  [call-arg]',
        f'{timeout_line}: error: Argument "timeout_s" to "generate" of "ActorWorker" has incompatible type "str"; '
        'expected "float | None"  [arg-type]',
    ]


# ----- at run time (in-process session) -----

POOL = ResourcePool(name="p", devices=2)
SPECS = {"producer": RoleSpec(cls=Producer, pool=POOL), "consumer": RoleSpec(cls=Consumer, pool=POOL),
         "ticker": RoleSpec(cls=Ticker, pool=POOL)}
COLUMNS = {"idx": torch.arange(4), "steps": torch.tensor([1, 2, 1, 2])}


def test_a_misspelt_method_fails_naming_the_registered_methods() -> None:
    async def main(session, roles, src):
        with pytest.raises(AttributeError) as e:
            roles.consumer.ecko(src)
        return str(e.value)

    message = run_local(SPECS, COLUMNS, POOL, main)
    assert "role 'consumer' (Consumer) has no registered method 'ecko'" in message
    assert "['echo', 'echo_balanced', 'needs_adv', 'total']" in message


def test_an_unknown_keyword_fails_with_the_signature_and_the_registered_methods() -> None:
    async def main(session, roles, src):
        with pytest.raises(TypeError) as e:
            roles.producer.produce(src, widht=3)
        return e

    e = run_local(SPECS, COLUMNS, POOL, main)
    assert isinstance(e.value, CallArgumentError)
    message = str(e.value)
    assert message.startswith("producer.produce(batch: Batch, *, width: int): ")
    assert "unexpected keyword argument 'widht'" in message
    assert "did you mean width=?" in message
    assert message.endswith("role 'producer' (Producer) has registered methods ['produce']")


def test_a_missing_argument_fails_before_anything_runs() -> None:
    async def main(session, roles, src):
        with pytest.raises(CallArgumentError, match=re.escape("producer.produce(batch: Batch, *, width: int): "
                                                             "missing a required argument: 'width'")):
            roles.producer.produce(src)
        return await roles.producer.produce(src, width=2)  # the session still works

    assert run_local(SPECS, COLUMNS, POOL, main).num_rows == 4


def test_a_wrong_keyword_on_a_stream_fails_at_call_time() -> None:
    async def main(session, roles, src):
        ticks = roles.ticker.tick(src, stream=StreamOptions(micro_batch=2))
        with pytest.raises(CallArgumentError, match=r"consumer\.echo\(batch: Batch\): .*'rows'.*"
                                                    r"registered methods \['echo'"):
            roles.consumer.echo(ticks, rows=2)
        return await collect(ticks)

    assert run_local(SPECS, COLUMNS, POOL, main).num_rows == 4


def test_a_stage_names_its_group_and_a_feed_gives_it_the_rows_its_pool_takes() -> None:
    async def main(session, roles, src):
        stage = roles.consumer.echo
        assert isinstance(stage, Stage) and stage.group is roles.consumer and stage.method == "echo"
        with pytest.raises(TypeError, match="Feed takes a role group's method"):
            Feed(src, producer=roles.ticker, stream=None)(len)
        options = StreamOptions(micro_batch=2)
        ticks = roles.ticker.tick(src, stream=options).rename(value="x")
        # The consumer shares the producer's pool: with the step streaming it takes
        # the whole batch once generation ends (no migration asked for) ...
        whole = Feed(ticks, producer=roles.ticker, stream=options)(roles.consumer.echo)
        # ... and without streaming it takes the rows as they are (here a stream).
        as_is = Feed(ticks, producer=roles.ticker, stream=None)(roles.consumer.echo)
        assert isinstance(whole, DataFuture) and isinstance(as_is, DataStream)
        return (await whole).num_rows, (await collect(as_is)).num_rows

    assert run_local(SPECS, COLUMNS, POOL, main) == (4, 4)
