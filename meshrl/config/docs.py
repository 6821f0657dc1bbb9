"""Config references from the code: every key of a config dataclass, its default
and the docstring written under the field (the one place a key is described).

`reference(schema)` lists (key, default, doc) for every leaf key, nested
sections included; `markdown` renders it as a table; `--help` prints it
(`meshrl.config.files.parse_cli`); `python -m algorithms.commands.config_reference`
writes each algorithm's table to `docs/config/`, and a test checks that they
are current and that no key lacks its docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
from typing import Any


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under it in the class body, over
    the dataclass's bases too (a subclass that redefines a field without a
    docstring keeps its base's)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, [*body[1:], None], strict=True):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            value = getattr(after, "value", None) if isinstance(after, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs[node.target.id] = " ".join(value.value.split())
    return docs


def reference(schema: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, docstring or '') of every leaf key of `schema`."""
    docs = field_docs(schema)
    rows: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(schema):
        factory = f.default_factory
        default = factory() if factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += reference(type(default), f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", default, docs.get(f.name, "")))
    return rows


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and value.startswith(REPO + os.sep):
        return os.path.relpath(value, REPO)  # a shipped file: the same in every checkout
    if isinstance(value, str):
        return value if value else '""'
    return str(value)


def markdown(schema: type, title: str) -> str:
    """A Markdown page: one table row per key (key, default, meaning)."""
    lines = [
        f"# {title}",
        "",
        "Generated from the config dataclasses' field docstrings by",
        "`python -m algorithms.commands.config_reference`; do not edit by hand.",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    for key, default, doc in reference(schema):
        cell, meaning = _show(default).replace("|", "\\|"), doc.replace("|", "\\|")
        lines.append(f"| `{key}` | `{cell}` | {meaning} |")
    return "\n".join(lines) + "\n"


def help_text(schema: type) -> str:
    """`--help`: every key with its default, and its meaning under it."""
    return "\n".join(
        f"  {key}={_show(default)}" + (f"\n      {doc}" if doc else "")
        for key, default, doc in reference(schema)
    )
