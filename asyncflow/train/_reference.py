"""The configuration reference, ``docs/config.md``, generated from the run
config's types: every section and key of an ``asyncflow train`` config with its
type, its default and the field's docstring (the string literal written under the
field in its class, read with :mod:`ast`), and each built-in algorithm's
``[algorithm]`` keys.

    python -m asyncflow.train._reference docs/config.md     # or: make docs

``tests/docs/test_docs_config_reference.py`` regenerates it and fails when the
committed file differs.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from asyncflow.algos import Algorithm, algorithms
from asyncflow.train._config import RunConfig

__all__ = ["Key", "Section", "config_reference", "sections", "undocumented"]

REGENERATE = "make docs"
"""The command that rewrites ``docs/config.md``."""

_MISSING = object()


@dataclass(frozen=True)
class Key:
    """One key of a section, as the reference shows it."""

    name: str
    """The key as written in the section (``steps``)."""
    type: str
    """Its type in config words (``int``, ``"auto" | "cpu"``, ``table``)."""
    default: str
    """Its default as TOML (``20``, ``"auto"``), ``required`` or ``unset``."""
    doc: str
    """The field's docstring, on one line; empty when it has none."""


@dataclass(frozen=True)
class Section:
    """One table of the config (``[train]``) or of an algorithm's settings."""

    title: str
    """How the table is written (``[train]``, ``[pools.<name>]``, ``[algorithm] name = "ppo"``)."""
    doc: str
    """The section type's docstring."""
    keys: tuple[Key, ...]
    """Its keys in declaration order."""


def sections() -> list[Section]:
    """Every section of the run config in the order of its fields: the top-level
    keys, ``[algorithm]`` (its ``name``, one section per built-in algorithm, then
    the tables nested in their settings), then the other sections depth first. An
    installed plug-in's algorithm is left out: it is not asyncflow's."""
    top, *rest = _walk(RunConfig, "", RunConfig(), skip=("algorithm",))
    built_in = [a for a in algorithms().values() if a.step.__module__.startswith("asyncflow.")]
    algos = [_algorithm_names(built_in)]
    nested: dict[str, type] = {}
    for algo in built_in:
        title = f'[algorithm] name = "{algo.name}"'
        algos.append(_section(algo.config, title, "algorithm", algo.config(), extra=_roles(algo)))
        for name, hint, _ in _fields(algo.config):
            table = _table_type(hint)
            if table is not None:
                nested.setdefault(f"algorithm.{name}", table)
    for path, cls in nested.items():
        algos += _walk(cls, path, None)
    return [top, *algos, *rest]


def undocumented() -> list[str]:
    """The keys without a docstring (``section.key``): every key should have one."""
    return [f"{s.title} {k.name}" for s in sections() for k in s.keys if not k.doc]


def config_reference() -> str:
    """``docs/config.md``: the Markdown reference of :func:`sections`."""
    every = sections()
    parts = [_HEADER]
    parts += [f"- [`{s.title}`](#{_slug(s.title)})" for s in every]
    for s in every:
        parts += ["", f"## `{s.title}`", "", _doc(s.doc), "", "| key | type | default | description |",
                  "|---|---|---|---|"]
        parts += [f"| `{k.name}` | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.doc)} |" for k in s.keys]
    return "\n".join(parts) + "\n"


_HEADER = f"""# Configuration reference

<!-- Generated from the config types by `{REGENERATE}` (asyncflow/train/_reference.py); do not edit:
edit the field's docstring and regenerate. -->

Every key of an `asyncflow train` config (TOML or YAML), with its type, its default
and what it does. This page is generated from the config types themselves
(`{REGENERATE}`), and a test fails when it is stale. A key is written in its
section (`[train]` then `steps = 50`) or on the command line as a dotted path
(`--set train.steps=50`). Unknown keys and wrong types are refused before
anything starts, naming the key. `unset` means the key is left out (TOML has no
null). A `table` key is a section of its own, below. How the sections fit
together: [concepts](concepts.md); the algorithms: [algorithms](algorithms.md).
"""


def _walk(cls: type, path: str, instance: Any, *, skip: tuple[str, ...] = ()) -> list[Section]:
    """The section of ``cls`` at ``path`` (``""``: the top level) and the sections
    of its table-valued keys, depth first. ``instance``: where the defaults come
    from (None: the fields' own defaults)."""
    out = [_section(cls, f"[{path}]" if path else "top level", path, instance, skip=skip)]
    for name, hint, default in _fields(cls):
        child = _child(path, name, hint)
        if name in skip or child is None:
            continue
        value = getattr(instance, name) if instance is not None else default
        out += _walk(child[1], child[0], value if _is_table(value) else _default_instance(child[1]))
    return out


def _child(path: str, name: str, hint: Any) -> tuple[str, type] | None:
    """The path and type of the section a key opens (``X``, ``X | None``,
    ``dict[str, X]``, ``list[X]`` of a Struct or dataclass ``X``), else None."""
    key = f"{path}.{name}" if path else name
    table = _table_type(hint)
    if table is not None:
        return key, table
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict and args and _is_table_type(args[1]):
        return f"{key}.<{_entry_name(name)}>", args[1]
    if origin is list and args and _is_table_type(args[0]):
        return f"[{key}]", args[0]
    return None


def _entry_name(field: str) -> str:
    return {"pools": "name", "placement": "role"}.get(field, "key")


def _section(cls: type, title: str, path: str, instance: Any, *, skip: tuple[str, ...] = (),
             extra: str = "") -> Section:
    docs = field_docs(cls)
    keys = []
    for name, hint, default in _fields(cls):
        if name in skip:
            continue
        value = getattr(instance, name) if instance is not None else default
        child = _child(path, name, hint)
        kind = _type(hint)
        if child is not None:
            link = f"[`[{child[0]}]`](#{_slug(f'[{child[0]}]')})"
            head, _, tail = kind.rpartition("table")  # the last: "table of table" is a table of them
            kind = f"{head}table {link}{tail}"
        keys.append(Key(name=_key(cls, name), type=kind, default=_default(value, hint), doc=docs.get(name, "")))
    doc = inspect.cleandoc(cls.__doc__ or "")
    return Section(title=title, doc=f"{doc}\n\n{extra}" if extra else doc, keys=tuple(keys))


def _algorithm_names(built_in: list[Algorithm[Any]]) -> Section:
    names = " | ".join(f'"{a.name}"' for a in built_in)
    doc = field_docs(RunConfig).get("algorithm", "")
    name = Key(name="name", type=f"{names} | a plug-in's name", default='"grpo"', doc=doc)
    return Section(title="[algorithm]", doc="Which algorithm trains; its settings are the keys beside "
                   "`name`, one section per algorithm below.", keys=(name,))


def _roles(algo: Algorithm[Any]) -> str:
    required, optional = algo.roles.required(), algo.roles.optional()
    text = f"Roles it places: {', '.join(f'`{r}`' for r in required)}"
    return text + (f"; when wanted: {', '.join(f'`{r}`' for r in optional)}." if optional else ".")


def _key(cls: type, name: str) -> str:
    """The key a config file spells field ``name`` with (a Struct may rename it:
    ``[env] class`` is the field ``cls``)."""
    if issubclass(cls, msgspec.Struct):
        return next(f.encode_name for f in msgspec.structs.fields(cls) if f.name == name)
    return name


def _fields(cls: type) -> list[tuple[str, Any, Any]]:
    """``(name, type, default)`` of a msgspec Struct's or a dataclass's fields
    (``_MISSING``: required)."""
    if issubclass(cls, msgspec.Struct):
        return [(f.name, f.type, _struct_default(f)) for f in msgspec.structs.fields(cls)]
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(typing.cast(Any, cls)):
        default = (f.default if f.default is not dataclasses.MISSING
                   else f.default_factory() if f.default_factory is not dataclasses.MISSING else _MISSING)
        out.append((f.name, hints[f.name], default))
    return out


def _struct_default(f: msgspec.structs.FieldInfo) -> Any:
    if f.default is not msgspec.NODEFAULT:
        return f.default
    return f.default_factory() if f.default_factory is not msgspec.NODEFAULT else _MISSING


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under it), from ``cls`` and
    the classes it inherits from; a subclass's wins."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base.__module__ in ("builtins", "msgspec"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(base))
        except (OSError, TypeError):  # made at run time (msgspec.defstruct): no source
            continue
        out.update(_docstrings(ast.parse(source).body[0]))
    return out


def _docstrings(node: ast.stmt) -> Iterator[tuple[str, str]]:
    assert isinstance(node, ast.ClassDef)
    for field, after in zip(node.body, [*node.body[1:], None], strict=True):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            yield field.target.id, _doc(after.value.value)


def _doc(text: str) -> str:
    """A docstring as Markdown on one paragraph per blank line: reST's ``x`` and
    :role:`~a.b.x` become `x`."""
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"`\1`", inspect.cleandoc(text))
    text = text.replace("``", "`")
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))


def _is_table_type(t: Any) -> bool:
    return isinstance(t, type) and (issubclass(t, msgspec.Struct) or dataclasses.is_dataclass(t))


def _is_table(value: Any) -> bool:
    return _is_table_type(type(value))


def _table_type(hint: Any) -> type | None:
    """The Struct or dataclass of a table-valued key (``X`` or ``X | None``), else None."""
    if _is_table_type(hint) and hint is not msgspec.Struct:
        return typing.cast(type, hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1 and _is_table_type(inner[0]):
            return typing.cast(type, inner[0])
    return None


def _default_instance(cls: type) -> Any:
    """``cls()`` when every field has a default, else None (the fields' own defaults)."""
    try:
        return cls()
    except (TypeError, msgspec.ValidationError):
        return None


def _type(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if hint is type(None):
        return "unset"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in hint)
    if _is_table_type(hint):
        return "table"
    if origin in (list, tuple):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {_type(args[1])}"
    return getattr(hint, "__name__", str(hint))


def _default(value: Any, hint: Any) -> str:
    if value is _MISSING:
        return "required"
    if value is None:
        return "unset"
    if _is_table(value):
        table = _table_type(hint) or type(value)
        base = _default_instance(table)
        differ = {name: getattr(value, name) for name, _, default in _fields(table)
                  if getattr(value, name) != (getattr(base, name) if base is not None else default)}
        return _toml(differ) if differ else "see its section"
    return _toml(value)


def _toml(value: Any) -> str:
    """``value`` as a TOML literal."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{k} = {_toml(v)}" for k, v in value.items() if v is not None]  # None: the key left out
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if _is_table(value):
        return _toml({_key(type(value), name): getattr(value, name) for name, _, _ in _fields(type(value))})
    return repr(value)


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell: pipes escaped, paragraphs as line breaks."""
    return text.replace("|", "\\|").replace("\n\n", "<br><br>")


def _slug(title: str) -> str:
    """The anchor a forge (GitHub, Gitea) gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    """Write the reference to the path given (``docs/config.md``), or print it."""
    args = sys.argv[1:] if argv is None else argv
    text = config_reference()
    if args:
        Path(args[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
