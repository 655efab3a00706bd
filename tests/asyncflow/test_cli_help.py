"""``asyncflow --help`` and ``--version``: they answer without importing torch,
Ray or the runtime, and every subcommand and option says what it does."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from asyncflow.cli import _COMMANDS, _parser, main

ROOT = Path(__file__).parents[2]

_PROBE = """
import contextlib, io, sys
from asyncflow.cli import main
for argv in (["--help"], ["train", "--help"], ["plan", "--help"], ["sft", "--help"], ["--version"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    print(out.getvalue())
print("LOADED", sorted(m for m in ("torch", "ray", "transformers", "vllm", "channels._batch", "channels._remote",
                                   "workers", "asyncflow.train", "asyncflow.runtime._session") if m in sys.modules))
"""


def test_help_and_version_import_no_engine_or_runtime() -> None:
    env = {**os.environ, "COLUMNS": "200"}  # argparse wraps at the terminal's width
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.rstrip().splitlines()[-1] == "LOADED []"
    assert f"asyncflow {metadata.version('asyncflow')}" in out
    for description in _COMMANDS.values():
        assert out.count(description) >= 2  # in the command list and in the command's own help


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"asyncflow {metadata.version('asyncflow')}"


def test_every_subcommand_and_option_has_a_help_line() -> None:
    parser = _parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(_COMMANDS)  # type: ignore[arg-type]
    for name, command in sub.choices.items():  # type: ignore[union-attr]
        assert command.description == _COMMANDS[name]
        for action in command._actions:
            assert action.help, f"asyncflow {name} {action.option_strings or action.dest} has no help"
    train = {o for a in sub.choices["train"]._actions for o in a.option_strings}  # type: ignore[index]
    assert {"--no-progress", "--address", "--resume", "--clean", "--set", "--verbose"} <= train


def test_no_asyncflow_module_imports_bench() -> None:
    # bench sits above asyncflow: it uses asyncflow, never the other way round.
    for path in (ROOT / "asyncflow").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "bench" or n.startswith("bench.") for n in names), f"{path} imports {names}"
