"""The README and docs/ say what the code does: every fenced code block is run or
checked here, or marked as run by another test, or marked as not run (with the
reason); every relative link resolves; the README is a door of at most 250 lines
that links every page; troubleshooting covers every asyncflow error class.

A block's mark is an HTML comment on the line before it:

- ``<!-- not run: REASON -->``: shown only (still parsed when it is Python, TOML,
  YAML or JSON);
- ``<!-- run by: tests/PATH.py::test_name -->``: that test runs it;
- ``<!-- same as: PATH -->`` or ``<!-- same as: PATH#REGION -->``: the block is the
  file, or the lines between ``# [docs:REGION]`` and ``# [/docs:REGION]`` in it
  (both dedented);
- ``<!-- output of: asyncflow ARGS -->``: what the command prints (``--help`` and
  ``--version`` only: they are instant);
- ``<!-- checked: REASON -->`` on a shell block of ``asyncflow train|sft|plan``
  commands: each command's config loads, with its ``--set`` overrides (nothing
  trains).

Unmarked blocks run here: Python is executed, TOML is loaded as a run config in
place of the main job's tables (``examples/arith_grpo.toml``), JSON and YAML are
decoded. Any other unmarked block fails.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import shlex
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from asyncflow.cli import main
from asyncflow.train import load_config

ROOT = Path(__file__).parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
MAIN_JOB = ROOT / "examples" / "arith_grpo.toml"
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_MARK = re.compile(r"^\s*<!--\s*(?P<kind>not run|run by|same as|output of|checked):\s*(?P<arg>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    lang: str
    text: str
    mark: str
    arg: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` with the mark on the line before it (blank lines
    between are allowed)."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, indent, fence = i, len(m["indent"]), m["fence"]
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        body = textwrap.dedent("\n".join(line[indent:] if line[:indent].isspace() else line
                                         for line in lines[start + 1:i]))
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(prev)
        out.append(Block(page=page, line=start + 1, lang=m["lang"].lower(), text=body + "\n",
                         mark=mark["kind"] if mark else "", arg=mark["arg"] if mark else ""))
        i += 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def _parse(block: Block) -> object:
    """The block decoded in its language (a syntax error fails), or None."""
    if block.lang in ("python", "py"):
        return compile(block.text, str(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if block.lang == "toml":
        return tomllib.loads(block.text)
    if block.lang in ("yaml", "yml"):
        return yaml.safe_load(block.text)
    if block.lang == "json":
        return [json.loads(line) for line in block.text.splitlines() if line.strip()]
    return None


def _region(spec: str) -> str:
    path, _, region = spec.partition("#")
    text = (ROOT / path).read_text()
    if region:
        begin, end = f"# [docs:{region}]", f"# [/docs:{region}]"
        assert begin in text and end in text, f"{path} has no region {region} ({begin} ... {end})"
        text = text[text.index("\n", text.index(begin)) + 1:text.index(end)]
        text = text[:text.rindex("\n") + 1]
    return textwrap.dedent(text)


def _load_commands(block: Block) -> None:
    """Each ``asyncflow train|sft|plan CONFIG [--set k=v ...]`` line's config,
    loaded and validated as the command would."""
    commands = [line.partition(" #")[0] for line in block.text.splitlines() if line.strip()]
    assert commands, f"{block}: no command"
    for command in commands:
        words = shlex.split(command)
        assert words[0].endswith("asyncflow") and words[1] in ("train", "sft", "plan"), f"{block}: {command}"
        config = next(w for w in words[2:] if not w.startswith("-"))
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        overrides: dict[str, object] = {}
        for pair in sets:
            key, _, value = pair.partition("=")
            try:
                overrides[key] = json.loads(value)
            except json.JSONDecodeError:  # a string, as the CLI reads it
                overrides[key] = value
        load_config(ROOT / config, overrides)


def _load_over_main_job(tables: dict[str, object], tmp_path: Path) -> None:
    """A config fragment's tables in place of the main job's, loaded and validated
    (written as JSON, which YAML reads)."""
    path = tmp_path / "fragment.yaml"
    path.write_text(json.dumps(tomllib.loads(MAIN_JOB.read_text()) | tables))
    load_config(path)


@pytest.mark.parametrize("block", ALL, ids=str)
def test_every_code_block_is_run_checked_or_marked(block: Block, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = _parse(block) if block.mark != "same as" else None  # a file's region: the file compiles
    if block.mark == "not run":
        assert block.arg, f"{block}: say why it is not run (<!-- not run: REASON -->)"
    elif block.mark == "run by":
        path, _, name = block.arg.partition("::")
        assert re.search(rf"^(async )?def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), (
            f"{block}: {block.arg} does not exist")
    elif block.mark == "same as":
        assert textwrap.dedent(block.text) == _region(block.arg), f"{block} differs from {block.arg}"
    elif block.mark == "checked":
        assert block.lang in ("bash", "sh", "shell"), f"{block}: only shell blocks of asyncflow commands"
        _load_commands(block)
    elif block.mark == "output of":
        command, *argv = block.arg.split()
        assert command == "asyncflow" and argv and set(argv) & {"--help", "--version"}, block.arg
        monkeypatch.setenv("COLUMNS", "100")
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            main(argv)
        assert block.text == out.getvalue(), f"{block}: the output of `{block.arg}` changed"
    elif block.lang in ("python", "py"):
        assert isinstance(parsed, type(compile("", "", "exec")))
        exec(parsed, {"__name__": "__docs__"})
    elif block.lang == "toml":
        assert isinstance(parsed, dict)
        _load_over_main_job(parsed, tmp_path)
    elif block.lang not in ("json", "yaml", "yml"):
        pytest.fail(f"{block}: run it here, or mark it (<!-- not run: REASON --> or <!-- run by: TEST -->)")


def _slug(heading: str) -> str:
    """The anchor a forge gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    fenced = re.sub(r"(?ms)^\s*```.*?^\s*```", "", text)
    return ({_slug(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", fenced)}
            | set(re.findall(r'<a id="([^"]+)"', text)))


_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = re.sub(r"(?ms)^\s*```.*?^\s*```", "", page.read_text())
    for target in _LINK.findall(text):
        if re.match(r"\w+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.relative_to(ROOT)}: {target}: no such heading"


def test_the_readme_is_a_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "## Contents" in readme
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _LINK.findall(readme)}
    for page in (ROOT / "docs").glob("*.md"):
        assert page.resolve() in linked, f"README.md does not link {page.relative_to(ROOT)}"
    index = (ROOT / "docs" / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert page.name == "README.md" or f"({page.name})" in index, f"docs/README.md does not link {page.name}"


def _error_classes() -> set[str]:
    """Every class deriving from AsyncflowError in channels/, asyncflow/ and workers/,
    read from the source (no imports)."""
    bases: dict[str, set[str]] = {}
    for package in ("channels", "asyncflow", "workers"):
        for file in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    bases.setdefault(node.name, set()).update(names)
    found = {"AsyncflowError"}
    while True:
        more = {name for name, parents in bases.items() if parents & found} - found
        if not more:
            return found
        found |= more


def test_troubleshooting_covers_every_error_class() -> None:
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    headings = set(re.findall(r"(?m)^### `(\w+)`", page))
    missing = sorted(_error_classes() - headings)
    assert not missing, f"docs/troubleshooting.md has no ### `Name` section for {missing}"
