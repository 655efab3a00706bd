"""The built-in algorithms call every stage through typed role groups: mypy with
``asyncflow.mypy_plugin`` reports a misspelt stage method or a wrong keyword in a
copy of one (``_ppo.py``, broken on purpose), at the line of the mistake. The
unbroken built-ins type-check clean in the Makefile's mypy run over ``asyncflow``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workers import endpoints
from workers.roles import CriticWorker

ROOT = Path(__file__).resolve().parents[2]
PPO = ROOT / "asyncflow" / "algos" / "_ppo.py"
FED = "feed(r.critic.values)"
UPDATE = "r.critic.update(batch)"
BREAKS = {
    "misspelt_stage.py": (FED, "feed(r.critic.value)"),
    "wrong_feed_keyword.py": (FED, "feed(r.critic.values, temperature=1.0)"),
    "wrong_call_keyword.py": (UPDATE, "r.critic.update(batch, los=None)"),
}


def _line_of(text: str, needle: str) -> int:
    [line] = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return line


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, int], dict[str, list[str]]]:
    """The line of each mistake and mypy's errors, per broken copy of ``_ppo.py``."""
    api = pytest.importorskip("mypy.api")  # GPU machines may run the suite without the dev tools
    source = PPO.read_text()
    where, out = tmp_path_factory.mktemp("broken_algos"), {}
    lines: dict[str, int] = {}
    for name, (good, bad) in BREAKS.items():
        assert source.count(good) == 1, f"_ppo.py no longer has {good!r} once; update the test"
        (where / name).write_text(source.replace(good, bad))
        lines[name], out[name] = _line_of(source, good), []
    stdout, stderr, _ = api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"),
        "--no-error-summary", "--hide-error-context", "--no-pretty", "--show-error-codes",
        *(str(where / n) for n in BREAKS),
    ])
    assert not stderr, stderr
    for line in stdout.splitlines():
        if ": note: " not in line:
            out[Path(line.split(":", 1)[0]).name].append(line.split(":", 1)[1])
    return lines, out


def test_mypy_reports_a_misspelt_stage_in_a_built_in(broken: tuple[dict[str, int], dict[str, list[str]]]) -> None:
    lines, out = broken
    methods = ", ".join(sorted(endpoints(CriticWorker)))
    assert out["misspelt_stage.py"] == [
        f'{lines["misspelt_stage.py"]}: error: "value" of role class "CriticWorker" is not a registered method '
        f'(did you mean "values"?); its registered methods are: {methods}  [attr-defined]']


def test_mypy_reports_a_wrong_keyword_to_a_fed_stage_and_to_a_call(
        broken: tuple[dict[str, int], dict[str, list[str]]]) -> None:
    lines, out = broken
    [fed] = out["wrong_feed_keyword.py"]
    assert re.fullmatch(rf'{lines["wrong_feed_keyword.py"]}: error: Unexpected keyword argument "temperature" '
                        r'for "__call__" of "Feed"  \[call-arg\]', fed), fed
    [called] = out["wrong_call_keyword.py"]
    assert re.fullmatch(rf'{lines["wrong_call_keyword.py"]}: error: Unexpected keyword argument "los" for '
                        r'"update" of "CriticWorker"(; did you mean "loss"\?)?  \[call-arg\]', called), called


def test_the_built_ins_import_only_public_faces() -> None:
    private = re.compile(r"^\s*(?:from|import) (asyncflow\._\w+|workers(?:\.\w+)*\._\w+|channels(?:\.\w+)*\._\w+)",
                         re.MULTILINE)
    found = {p.name: private.findall(p.read_text()) for p in (ROOT / "asyncflow" / "algos").glob("*.py")}
    assert {name: hits for name, hits in found.items() if hits} == {}
