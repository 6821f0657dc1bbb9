"""Meshes that live across notebook cells.

`keep("name", lambda: RoleMeshes({...}))` stops whatever was kept under "name"
before (so re-running a cell that spawns meshes never leaks processes), starts
the new one and holds it until `stop("name")`, `stop()` (everything), or the
interpreter exits. Works for anything with a `stop()`, `close()` or `shutdown()`
method: `RoleMeshes`, a `Run`, an algorithm.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

_kept: dict[str, Any] = {}


def keep(name: str, start: Callable[[], T]) -> T:
    """Stop what `name` held, then `start()` and hold the result under `name`."""
    stop(name)
    _kept[name] = value = start()
    return value


def kept() -> dict[str, Any]:
    """What is held now, by name."""
    return dict(_kept)


def stop(name: str | None = None) -> None:
    """Stop what `name` holds (everything when None). Never raises."""
    names = list(_kept) if name is None else [name]
    for key in names:
        value = _kept.pop(key, None)
        if value is None:
            continue
        try:
            (getattr(value, "stop", None) or getattr(value, "close", None) or value.shutdown)()
        except Exception as error:  # noqa: BLE001 - keep stopping the rest
            logger.warning("could not stop %s: %s", key, error)


atexit.register(stop)
