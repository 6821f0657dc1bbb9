"""SFT without meshes: the assistant-only loss mask token by token, bad rows refused
with one line, the same examples from every file format, and a model path that is no
model or run refused."""

import json

import pytest

from algorithms.sft import SFTConfig
from meshrl.config import ConfigError, load_config
from meshrl.envs.dataset import DatasetError
from meshrl.envs.sft_data import conversation, load_examples, pair
from meshrl.model.tokenizer import build_char_tokenizer
from tests.support.sft import CONFIG, chat_tokenizer


@pytest.mark.unit
def test_only_the_assistants_tokens_count():
    tok = chat_tokenizer()
    messages = [
        {"role": "system", "content": "be"},
        {"role": "user", "content": "12>"},
        {"role": "assistant", "content": "21"},
        {"role": "user", "content": "34>"},
        {"role": "assistant", "content": "43"},
    ]
    example = conversation(tok, messages, "row 0")
    assert tok.decode(example.prompt) == "s:be|u:12>|a:"
    tokens = tok.convert_ids_to_tokens(example.target)
    expected = [  # each assistant turn: its text, its EOS and the "|" the template closes it with
        ("2", 1),
        ("1", 1),
        ("</s>", 1),
        ("|", 1),
        ("u", 0),
        (":", 0),
        ("3", 0),
        ("4", 0),
        (">", 0),
        ("|", 0),
        ("a", 0),
        (":", 0),
        ("4", 1),
        ("3", 1),
        ("</s>", 1),
        ("|", 1),
    ]
    assert list(zip(tokens, example.counted, strict=True)) == expected
    # A pair is the conversation [user, assistant] with a template ...
    assert pair(tok, "12>", "21", "row 1") == conversation(tok, messages[1:3], "row 1")
    # ... and the prompt as RL sees it (BOS first) then the completion and EOS without one.
    plain = build_char_tokenizer()
    example = pair(plain, "12>", "21", "row 1")
    assert plain.convert_ids_to_tokens(example.prompt) == ["<s>", "1", "2", ">"]
    assert plain.convert_ids_to_tokens(example.target) == ["2", "1", "</s>"]
    assert example.counted == [1, 1, 1]


@pytest.mark.unit
def test_bad_rows_are_refused_naming_the_file_and_row(tmp_path):
    tok, path = chat_tokenizer(), tmp_path / "data.jsonl"
    fields = ("prompt", "completion", "messages")

    def refused(rows, match, tokenizer=tok):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        with pytest.raises(DatasetError, match=match):
            load_examples(str(path), tokenizer, fields, context=256)

    ok = {"prompt": "1>", "completion": "1"}
    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    refused([ok, user_only], rf"{path}, line 2: no assistant turn")
    refused([ok, {"text": "x"}], r"line 2: needs 'messages' or 'prompt' and 'completion'")
    refused([{"prompt": "1" * 300, "completion": "1"}], r"line 1: 3\d\d tokens do not fit")
    chat = {"messages": [{"role": "user", "content": "1>"}, {"role": "assistant", "content": "1"}]}
    refused(
        [chat],
        "line 1: a conversation needs a tokenizer with a chat template",
        build_char_tokenizer(),
    )
    # A template that drops what earlier assistant turns said once a later turn comes.
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}a:..|"
        "{% else %}{{ m['role'][0] }}:{{ m['content'] }}|{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    two = {"messages": chat["messages"] * 2}
    refused([two], "line 1: the chat template renders earlier turns differently")


@pytest.mark.unit
def test_jsonl_parquet_and_save_to_disk_give_the_same_examples(tmp_path):
    import datasets

    rows = [
        {"messages": [{"role": "user", "content": "12>"}, {"role": "assistant", "content": "21"}]},
        {"messages": [{"role": "user", "content": "34>"}, {"role": "assistant", "content": "43"}]},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "rows"))
    tok, fields = chat_tokenizer(), ("prompt", "completion", "messages")
    loaded = [
        load_examples(str(tmp_path / name), tok, fields, context=256)
        for name in ("rows.jsonl", "rows.parquet", "rows")
    ]
    assert loaded[0] == loaded[1] == loaded[2] and len(loaded[0]) == 2


@pytest.mark.unit
def test_a_model_path_that_is_no_model_or_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path.*expected a save_pretrained directory"):
        load_config(SFTConfig, CONFIG, [f"model.path={tmp_path}"])
