"""docs/config.md is generated from the config types (asyncflow.train._reference):
the committed file equals a fresh generation, every key has a docstring, and the
generator reads fields, types, defaults and docstrings as it says."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from asyncflow.train._reference import (
    REGENERATE,
    config_reference,
    field_docs,
    sections,
    undocumented,
)

ROOT = Path(__file__).parents[2]


def test_the_committed_reference_is_current() -> None:
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == config_reference(), (
        f"docs/config.md is stale (the config types changed): run `{REGENERATE}` "
        "(or .venv/bin/python -m asyncflow.train._reference docs/config.md) and commit it")


def test_every_key_has_a_docstring() -> None:
    assert undocumented() == [], "write a docstring under each of these fields, then run " + REGENERATE


def test_every_section_and_algorithm_is_there() -> None:
    titles = {s.title for s in sections()}
    for title in ("top level", "[train]", "[actor]", "[pools.<name>]", "[placement.<role>]",
                  "[placement.<role>.gen]", "[[reward.functions]]", "[algorithm.sampling]", "[algorithm.policy]"):
        assert title in titles
    for name in ("grpo", "ppo", "dapo", "rloo", "remax", "safe_rlhf"):
        assert f'[algorithm] name = "{name}"' in titles


class _Inner(msgspec.Struct, frozen=True, kw_only=True):
    """An inner table."""

    n: int = 1
    """How many."""
    mode: Literal["a", "b"] = "a"
    """Which one."""


class _Outer(msgspec.Struct, frozen=True, kw_only=True):
    """An outer table."""

    inner: _Inner = _Inner(n=4)
    """The ``inner`` table, :class:`~somewhere._Inner`."""
    maybe: float | None = None
    undocumented_names: list[str] = msgspec.field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class _Derived:
    """A dataclass."""

    size: int = 3
    """Its size.

    Second paragraph."""


def test_docstrings_under_fields_are_read_as_markdown() -> None:
    assert field_docs(_Outer) == {"inner": "The `inner` table, `_Inner`."}
    assert field_docs(_Derived) == {"size": "Its size.\n\nSecond paragraph."}


def test_types_and_defaults_in_config_words(monkeypatch) -> None:
    import asyncflow.train._reference as reference

    monkeypatch.setattr(reference, "RunConfig", _Outer)
    monkeypatch.setattr(reference, "algorithms", dict)
    top, _names, inner = reference.sections()
    keys = {k.name: k for k in top.keys}
    # a table's default names what differs from the table's own defaults
    assert keys["inner"].default == "{ n = 4 }" and "[`[inner]`](#inner)" in keys["inner"].type
    assert (keys["maybe"].type, keys["maybe"].default) == ("float | unset", "unset")
    assert (keys["undocumented_names"].type, keys["undocumented_names"].default) == ("list of str", "[]")
    assert inner.title == "[inner]"
    assert [(k.name, k.type, k.default) for k in inner.keys] == [("n", "int", "4"), ("mode", '"a" | "b"', '"a"')]
