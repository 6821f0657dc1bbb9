"""SFT: the assistant-only loss mask token by token, bad rows refused with one
line, and on real meshes a conversation dataset trained on a model loaded by
path whose held-out NLL falls, then a GRPO run and an SFT run started from its
final model and from its checkpoint."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from algorithms.cli import main as cli_main
from algorithms.grpo import GRPO, GRPOConfig
from algorithms.sft import SFT, SFTConfig
from meshrl.config import ConfigError, ModelConfig, load_config
from meshrl.envs.dataset import DatasetError
from meshrl.envs.sft_data import conversation, load_examples, pair
from meshrl.loop.export import model_source
from meshrl.model.models import load_model
from meshrl.model.tokenizer import build_char_tokenizer
from tests.conftest import DEFAULT_CONFIG, REPO
from tests.test_algorithms import QUIET, undocumented_metrics

CONFIG = os.path.join(REPO, "algorithms", "configs", "sft.yaml")
# A chat template over the character tokenizer: "s:" system, "u:" user, "a:"
# assistant, each assistant turn closed by EOS.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


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


def chat_model(path) -> str:
    """The embedded tiny Llama and the chat tokenizer, saved by `save_pretrained`."""
    load_model(ModelConfig()).save_pretrained(path)
    chat_tokenizer().save_pretrained(path)
    return str(path)


def reversal_conversations(path, count: int = 300) -> str:
    """Two-turn conversations: reverse the digits, then reverse them again."""
    rows = []
    for i in range(count):
        digits = f"{(i * 37) % 1000:03d}"
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"{digits}>"},
                    {"role": "assistant", "content": digits[::-1]},
                    {"role": "user", "content": "again>"},
                    {"role": "assistant", "content": digits},
                ]
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sft_on_conversations_then_grpo_and_sft_from_its_output(tmp_path, no_stray_procs):
    model = chat_model(tmp_path / "model")
    cfg = load_config(
        SFTConfig,
        CONFIG,
        [
            f"model.path={model}",
            f"data.path={reversal_conversations(tmp_path / 'chats.jsonl')}",
            "steps=40",
            "eval.every=20",
            "placement.trainer=2",
            "checkpoint.every=20",
            f"run.dir={tmp_path}",
            "run.name=sft",
            *QUIET,
            "run.save_final=true",
        ],
    )
    records = SFT(cfg).run()
    assert [r["step"] for r in records] == list(range(40))
    assert not undocumented_metrics(records, "algorithms/sft.md")
    before = records[0]["eval/nll_before"]
    evals = [r["eval/nll"] for r in records if "eval/nll" in r]
    assert len(evals) == 2 and evals[-1] < 0.5 * before, (before, evals)
    # Only the assistant's tokens count: 2 turns of 3 digits + EOS + "|" a row.
    assert all(r["tokens/trained"] == 32 * 2 * 5 for r in records)

    # GRPO starts from the SFT run's directory: its final model, loaded by path.
    run_dir = tmp_path / "sft"
    final = load_file(run_dir / "final" / "model.safetensors")
    grpo_cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            f"model.path={run_dir}",
            "warm_start.steps=0",
            f"run.dir={tmp_path}",
            "run.name=grpo",
            *QUIET,
        ],
    )
    grpo = GRPO(grpo_cfg)
    try:
        grpo.run(0)  # the meshes up, version 0 on every replica, no step
        (weights,) = [w for w in grpo.sup.call_all(grpo.trainer, "parameters") if w]
        assert weights.keys() == final.keys()
        assert all(torch.equal(weights[name], final[name]) for name in final)
        assert grpo.step()["reward/mean"] > 0.3  # the SFT model answers (measured: 0.48)
    finally:
        grpo.close()

    # `meshrl eval` on the SFT run: the sections it needs of another algorithm's config.
    code = cli_main(
        [
            "eval",
            str(run_dir),
            "--config",
            DEFAULT_CONFIG,
            "eval.sets.heldout.prompts=8",
            "eval.sets.heldout.k=2",
            f"run.dir={tmp_path}",
            "run.name=evaluated",
        ]
    )
    assert code == 0
    with open(tmp_path / "evaluated" / "eval.json") as f:
        figures = json.load(f)
    assert figures["model"] == str(run_dir / "final") and figures["eval/heldout/reward"] > 0.2
    assert 0 <= figures["eval/heldout/pass@1"] <= figures["eval/heldout/pass@2"] <= 1

    # A checkpoint exports once to an HF directory beside it: the step-20 weights.
    checkpoint = run_dir / "checkpoints" / "step_00000020"
    hf = model_source(str(checkpoint))
    assert hf == str(checkpoint / "hf") and model_source(hf) == hf
    saved = torch.load(checkpoint / "trainer.pt", weights_only=False)["model"]
    exported = load_file(os.path.join(hf, "model.safetensors"))
    assert all(torch.equal(saved[name], exported[name]) for name in exported)


@pytest.mark.unit
def test_a_model_path_that_is_no_model_or_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path.*expected a save_pretrained directory"):
        load_config(SFTConfig, CONFIG, [f"model.path={tmp_path}"])
