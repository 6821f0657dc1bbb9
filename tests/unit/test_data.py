"""Preference files: JSONL and Parquet, clear errors, the held-out split, and
the shipped synthetic set."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from algorithms.dpo import SHIPPED_PREFERENCES, DPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.envs.dataset import DatasetError, PreferencePair, load_preferences, split_holdout
from meshrl.envs.digits import preference_pairs

pytestmark = pytest.mark.unit

RECORDS = [
    {"prompt": "12>", "chosen": "21", "rejected": "12"},
    {"prompt": "34>", "chosen": "43", "rejected": "33"},
]


def test_jsonl_and_parquet_read_the_same_pairs(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), parquet)
    want = [PreferencePair(**r) for r in RECORDS]
    assert load_preferences(str(jsonl)) == want
    assert load_preferences(str(parquet)) == want


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no records"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", ', "line 2"),
        ('{"prompt": "a", "chosen": "b"}\n', "line 1: missing key 'rejected'"),
        ('{"prompt": "a", "chosen": 3, "rejected": "c"}\n', "key 'chosen' is not a string"),
        ("[1, 2]\n", "line 1: expected an object"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message) as info:
        load_preferences(str(path))
    assert str(path) in str(info.value)


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_preferences(str(tmp_path / "none.jsonl"))
    other = tmp_path / "p.csv"
    other.write_text("x")
    with pytest.raises(DatasetError, match="expected a .jsonl or .parquet"):
        load_preferences(str(other))
    broken = tmp_path / "p.parquet"
    broken.write_text("not parquet")
    with pytest.raises(DatasetError, match="p.parquet"):
        load_preferences(str(broken))


def test_holdout_split_keeps_prompts_apart():
    pairs = [PreferencePair(f"{i % 20}>", "a", "b") for i in range(60)]
    train, held = split_holdout(pairs, 0.25, seed=3)
    assert len(train) + len(held) == 60
    assert len({p.prompt for p in held}) == 5
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert split_holdout(pairs, 0.25, seed=3) == (train, held)


def test_shipped_preference_set_is_the_generator_output():
    pairs = load_preferences(SHIPPED_PREFERENCES)
    assert [p.__dict__ for p in pairs] == preference_pairs(3, seed=0)
    assert len(pairs) == 1000
    assert all(p.chosen == p.prompt[:-1][::-1] != p.rejected for p in pairs)


def test_dpo_config_names_the_bad_key(tmp_path):
    with pytest.raises(ConfigError, match="data.path"):
        load_config(DPOConfig, None, [f"data.path={tmp_path}/none.jsonl"])
    with pytest.raises(ConfigError, match="beta"):
        load_config(DPOConfig, None, ["beta=0"])
    with pytest.raises(ConfigError, match="placement.trainer"):
        load_config(DPOConfig, None, ["batch_size=5", "placement.trainer=2"])
