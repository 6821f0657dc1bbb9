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
    pairs = [_pair(record, path, where) for where, record in _read_file(path, "")]
    if not pairs:
        raise DatasetError(f"dataset file {path}: no records")
    return pairs


def _read_file(path: str, key: str) -> list[tuple[str, dict]]:
    """(where, record) of each line of a .jsonl file or row of a .parquet file."""
    if path.endswith(".parquet"):
        return _read_parquet(path)
    if path.endswith((".jsonl", ".json")):
        return _read_jsonl(path)
    where = f"config key '{key}': {path}" if key else f"dataset file {path}"
    raise DatasetError(f"{where}: expected a .jsonl or .parquet file")


def _read_jsonl(path: str) -> list[tuple[str, dict]]:
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DatasetError(
                    f"dataset file {path}, line {number}: not UTF-8 (byte {error.start + 1} "
                    f"of the line: {raw[error.start : error.start + 1]!r})"
                ) from None
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


def read_records(path: str, key: str) -> list[tuple[str, dict]]:
    """(where, row) of each row of a `.jsonl` or `.parquet` file, or of a
    directory written by HF `datasets` `save_to_disk` (its `train` split when it
    holds several); `where` names the line or row for errors. Errors name `key`
    (the config key) and the file."""
    if os.path.isdir(path):
        records = _read_hf_dir(path, key)
    elif not os.path.isfile(path):
        raise DatasetError(f"config key '{key}': no such file or directory: {path}")
    else:
        records = _read_file(path, key)
    if not records:
        raise DatasetError(f"config key '{key}': {path} has no rows")
    for where, record in records:
        if not isinstance(record, dict):
            raise DatasetError(f"dataset file {path}, {where}: expected an object")
    return records


def read_rows(path: str, fields: list[str], key: str) -> list[dict]:
    """Task rows (`read_records`); every row must have `fields`."""
    records = read_records(path, key)
    for where, record in records:
        for name in fields:
            if name not in record:
                raise DatasetError(
                    f"dataset file {path}, {where}: missing field '{name}' "
                    f"(fields: {', '.join(sorted(record))})"
                )
    return [record for _, record in records]


_rows: dict[tuple, list[dict]] = {}
"""Task rows already read and checked, by file (path, size, mtime) and fields:
the config check reads a dataset once, and the task draws from the same rows."""


def task_rows(path: str, prompt_field: str, answer_field: str, key: str = "task.dataset"):
    """A task dataset's rows (`read_records`), each checked: the prompt field is
    non-empty text, the answer field (when the row has it) is text. Nothing is
    converted: a number or a list where text belongs (Parquet keeps types) is
    an error naming the file, the row and the field, as a null is."""
    stat = os.stat(path)
    cache = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns, prompt_field, answer_field)
    if cache in _rows:
        return _rows[cache]
    records = read_records(path, key)
    for where, record in records:
        for name, required in ((prompt_field, True), (answer_field, False)):
            if name not in record:
                if required:
                    raise DatasetError(
                        f"dataset file {path}, {where}: missing field '{name}' "
                        f"(fields: {', '.join(sorted(record))})"
                    )
                continue
            value = record[name]
            if not isinstance(value, str):
                what = "null" if value is None else f"a {type(value).__name__} ({value!r:.40})"
                raise DatasetError(
                    f"dataset file {path}, {where}: field '{name}' is {what}, not text"
                )
            if required and not value.strip():
                raise DatasetError(f"dataset file {path}, {where}: field '{name}' is empty")
    _rows[cache] = [record for _, record in records]
    return _rows[cache]


def _read_hf_dir(path: str, key: str) -> list[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"config key '{key}': {path} is a directory; reading a datasets save_to_disk "
            "directory needs the datasets package: pip install -e '.[datasets]'"
        ) from None
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as error:  # noqa: BLE001 - datasets raises several types for bad dirs
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DatasetError(f"config key '{key}': cannot load {path}: {first}") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[split]
    return [(f"row {i}", row) for i, row in enumerate(loaded)]
