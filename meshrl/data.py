"""Datasets read from local files.

Preference data (DPO): one record per line of a JSONL file, or one row of a
Parquet file, with string fields `prompt`, `chosen` and `rejected`. A bad file
gets one error naming the file and, for JSONL, the line.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


class DatasetError(ValueError):
    """A dataset file is missing, empty or malformed."""


@dataclass(frozen=True)
class PreferencePair:
    """A prompt with a preferred (`chosen`) and a dispreferred (`rejected`) response."""

    prompt: str
    chosen: str
    rejected: str


def load_preferences(path: str) -> list[PreferencePair]:
    """Read a `.jsonl` or `.parquet` preference file."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file not found: {path}")
    if path.endswith(".parquet"):
        records = _read_parquet(path)
    elif path.endswith((".jsonl", ".json")):
        records = _read_jsonl(path)
    else:
        raise DatasetError(f"dataset file {path}: expected a .jsonl or .parquet file")
    pairs = [_pair(record, path, where) for where, record in records]
    if not pairs:
        raise DatasetError(f"dataset file {path}: no records")
    return pairs


def _read_jsonl(path: str) -> list[tuple[str, dict]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as error:
                raise DatasetError(f"dataset file {path}, line {number}: {error.msg}") from None
    return records


def _read_parquet(path: str) -> list[tuple[str, dict]]:
    import pyarrow.parquet as pq  # a dependency of torchmonarch, so always present

    try:
        table = pq.read_table(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DatasetError(f"dataset file {path}: {error}") from None
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _pair(record: object, path: str, where: str) -> PreferencePair:
    if not isinstance(record, dict):
        raise DatasetError(
            f"dataset file {path}, {where}: expected an object with {PREFERENCE_FIELDS}"
        )
    for key in PREFERENCE_FIELDS:
        if key not in record:
            raise DatasetError(f"dataset file {path}, {where}: missing key '{key}'")
        if not isinstance(record[key], str):
            raise DatasetError(f"dataset file {path}, {where}: key '{key}' is not a string")
    return PreferencePair(record["prompt"], record["chosen"], record["rejected"])


def split_holdout(
    pairs: list[PreferencePair], fraction: float, seed: int = 0
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held_out): a seeded shuffle, the last `fraction` held out. Pairs
    that share a prompt stay on one side, so held-out prompts are unseen."""
    prompts = sorted({p.prompt for p in pairs})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[len(prompts) - round(len(prompts) * fraction) :]) if fraction else set()
    return [p for p in pairs if p.prompt not in held], [p for p in pairs if p.prompt in held]


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
