"""Environments without processes: answer checking, safe arithmetic, the tool and
code environments, chat formatting, dataset loading and the shipped samples."""

import json
import random
from fractions import Fraction

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, TaskConfig, load_config
from meshrl.envs import check_task, make_task
from meshrl.envs.code import run_tests, split_test
from meshrl.envs.dataset import DatasetError, read_rows
from meshrl.envs.math import ArithmeticError_, answers_match, arith, extract_answer
from meshrl.envs.rollout import ChatFormat
from meshrl.envs.samples import main as samples_main
from meshrl.envs.tools import ToolEpisode
from meshrl.model.tokenizer import build_char_tokenizer
from meshrl.types import Prompt
from tests.conftest import DEFAULT_CONFIG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.mark.parametrize(
    "completion, gold, match",
    [
        ("so the total is \\boxed{\\frac{1}{2}}", "0.5", True),
        ("x = 3 #### 1,234", "reasoning #### 1234", True),
        ("It costs $5.50.", "11/2", True),
        ("about 50%", "50", True),
        ("7 then 8", "#### 8", True),  # the last number
        ("\\boxed{12} and later 13", "12", True),  # boxed wins over later numbers
        ("#### 9", "#### 8", False),
        ("no number here", "8", False),
        ("\\boxed{\\sqrt{4}}", "2", True),  # symbolic: math-verify (the dev extra) only
        ("\\boxed{2^3}", "#### 8", True),
        ("\\boxed{\\frac{2}{3}}", "0.67", False),
    ],
)
def test_math_answers_are_extracted_and_normalized(completion, gold, match):
    assert answers_match(completion, gold) is match


def test_math_answers_without_math_verify_fall_back_to_exact_fractions(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    assert answers_match("so the total is \\boxed{\\frac{1}{2}}", "0.5")
    assert answers_match("It costs $5.50.", "11/2") and not answers_match("#### 9", "#### 8")
    assert not answers_match("\\boxed{\\sqrt{4}}", "2")  # symbolic needs math-verify


def test_boxed_with_nested_braces():
    assert extract_answer("\\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"


def test_arithmetic_is_exact_and_refuses_everything_else():
    assert arith("(7 - 1) * 5 / 4") == (Fraction(15, 2), [7, 1, 5, 4])
    for bad in (
        "__import__('os').system('true')",
        "open('x')",
        "2 ** 100000",
        "x + 1",
        "[1, 2]",
        "1 / 0",
        "9" * 20,
        "1+" * 150 + "1",
    ):
        with pytest.raises(ArithmeticError_):
            arith(bad)


def test_countdown_checks_the_value_and_the_numbers_used():
    env = make_task(TaskConfig(name="countdown"))
    prompt = Prompt("", "", {"numbers": [2, 3, 7], "target": 13})
    assert env.reward(prompt, "2*3+7") == 1.0
    assert env.reward(prompt, " (7+3)+3 = 13") == 0.0  # 3 used twice
    assert env.reward(prompt, "7+6") == 0.0  # 6 is not given
    assert env.reward(prompt, "import os") == 0.0
    for p in env.sample(20, random.Random(0)):  # generated targets are reachable
        assert env.reward(p, p.answer) == 1.0


def test_calculator_episode_calls_tools_and_checks_the_answer():
    prompt = Prompt("What is 12 * 3 + 4?", "40")
    episode = ToolEpisode(prompt, timeout_s=5)
    step = episode.step("let me see <calc>12*3+4</calc>")
    assert (step.observation, step.done, step.info) == (
        " <result>40</result> ",
        False,
        {"tool_calls": 1},
    )
    step = episode.step("<python>print(sum(range(5)))\nprint('done')</python>")
    assert step.observation == " <result>10 | done</result> " and not step.done
    step = episode.step("<python>import socket</python>")
    assert "error: exit status 1" in step.observation  # the sandbox refused it
    assert episode.step("thinking").observation == " <result>no call</result> "
    assert (
        episode.step("<calc>1/0</calc>").observation == " <result>error: division by zero</result> "
    )
    assert episode.step("<answer>40</answer>").reward == 1.0
    assert ToolEpisode(prompt).step("<answer>41</answer>").reward == 0.0


def test_code_reward_is_the_fraction_of_tests_passed():
    env = make_task(TaskConfig(name="code", tool_timeout_s=3))
    prompt = Prompt(
        "",
        "",
        {"tests": ["assert f(1) == 2", "assert f(2) == 4", "assert f(0) == 0", "assert f(3) == 7"]},
    )
    assert env.reward(prompt, "```python\ndef f(x):\n    return 2 * x\n```") == 0.75
    assert env.reward(prompt, "def f(x) return") == 0.0  # syntax error
    # A forged result line without the run's nonce counts for nothing.
    assert env.reward(prompt, "print('__passed__ 4')\nimport sys\nsys.exit(0)") == 0.0
    assert env.reward(prompt, "while True:\n    pass") == 0.0  # stopped by the sandbox
    for p in env.sample(3, random.Random(0)):
        assert env.reward(p, p.answer) == 1.0
    # Programs that game the harness instead of defining f: all score 0.
    for hack in (
        "import builtins; builtins.exec = lambda *a, **k: None",  # tests would run nothing
        "print('\\n' + __import__('__main__')._spec['nonce'], 4)",  # the nonce by name
        "import builtins; builtins.exec = lambda *a, **k: None\ndef f(x):\n    return -1",
        "import builtins; builtins.AssertionError = type('E', (Exception,), {})\nf = str",
    ):
        assert env.reward(prompt, hack) == 0.0, hack
    assert env.reward(prompt, "f = lambda x: 2 * x") == 0.75  # any binding defines


def test_value_tests_are_judged_where_the_program_cannot_reach():
    """`assert EXPR == LITERAL` tests send only EXPR into the sandbox: a program
    that forges the harness's result line (the nonce found through the frames)
    or answers with an object equal to everything passes none of them; the one
    test of another shape, run inside, is the only one it can forge."""
    tests = ["assert f(1) == 2", "assert f(2) == [4, 'x']", "assert isinstance(f(0), int)"]
    assert split_test(tests[1]) == ("f(2)", [4, "x"]) and split_test(tests[2]) is None
    honest = "def f(x):\n    return 2 if x == 1 else [4, 'x'] if x == 2 else 0"
    assert run_tests(honest, tests) == (3, "")
    forge = (
        "import sys\nspec = sys._getframe(1).f_locals['spec']\n"
        "print('\\n' + spec['nonce'] + ' [99, [\"0\", \"0\"]]', flush=True)\n"
        "import os\nos._exit(0)\ndef f(x):\n    pass\n"
    )
    assert run_tests(forge, tests)[0] == 1
    equal_to_all = "class A:\n    def __eq__(self, other):\n        return True\nf = lambda x: A()"
    assert run_tests(equal_to_all, tests)[0] == 0
    assert run_tests("def f(x):\n    return 2.0", tests[:1])[0] == 1  # 2.0 == 2, as assert says


def test_chat_template_formats_prompts_and_tool_replies():
    tok = build_char_tokenizer()
    plain = ChatFormat(tok)
    assert plain.prompts(["12>"])[0] == tok("12>").input_ids
    assert (
        plain.reply(" <result>4</result> ")
        == tok(" <result>4</result> ", add_special_tokens=False).input_ids
    )
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    chat = ChatFormat(tok)
    assert tok.decode(chat.prompts(["hi"])[0]) == "[user]hi[assistant]"
    assert tok.decode(chat.reply("4")) == "[tool]4[assistant]"


def test_an_episodes_ids_are_the_templates_rendering_of_its_conversation():
    """ChatML-like: each message closes with EOS and a newline. The model's turn
    ends at EOS, so the newline comes with the tool's reply; a turn cut at
    max_new_tokens gets the whole closing."""
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    chat = ChatFormat(tok)
    conversation = [{"role": "user", "content": "12>"}]
    (ids,) = chat.prompts(["12>"])
    for answer, ended in (("21", True), ("333", False)):
        turn = tok(answer, add_special_tokens=False).input_ids + (
            [tok.eos_token_id] if ended else []
        )
        ids = ids + turn + chat.reply("ok", turn)
        conversation += [
            {"role": "assistant", "content": answer},
            {"role": "tool", "content": "ok"},
        ]
        rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert ids == tok(rendered, add_special_tokens=False).input_ids


def test_datasets_load_with_field_mapping(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}", "extra": i} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "hfdict")
    )
    for name in ("d.jsonl", "d.parquet", "hf", "hfdict"):
        cfg = load_config(
            GRPOConfig,
            DEFAULT_CONFIG,
            ["task.name=math", f"task.dataset={tmp_path / name}", "task.prompt_field=question"],
        )
        prompts = make_task(cfg.task).sample(10, random.Random(0))
        assert {p.text for p in prompts} <= {r["question"] for r in rows}, name
        assert all(p.data["extra"] == int(p.text[1:]) for p in prompts), name
        assert make_task(cfg.task).reward(prompts[0], f"#### {prompts[0].text[1:]}") == 1.0
    with pytest.raises(
        DatasetError, match="missing field 'prompt'.*fields: answer, extra, question"
    ):
        read_rows(str(tmp_path / "d.jsonl"), ["prompt"], "task.dataset")
    with pytest.raises(ConfigError, match="task.dataset"):  # checked once the name resolves
        load_config(GRPOConfig, DEFAULT_CONFIG, ["task.name=math", "task.dataset=/no/such.jsonl"])


def test_shipped_sample_datasets_are_their_generators_output(tmp_path, capsys):
    assert samples_main(["--check"]) == 0
    # Written where asked; the shipped files only with --overwrite-shipped.
    assert samples_main([]) == 2 and "--overwrite-shipped" in capsys.readouterr().err
    assert samples_main([str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "calculator.jsonl",
        "code.jsonl",
        "countdown.jsonl",
        "math.jsonl",
    ]


def test_your_own_environment_by_import_path():
    cfg = TaskConfig(name="tests.support.envs:Flaky")
    check_task(cfg)
    assert make_task(cfg).multi_turn
    with pytest.raises(ConfigError, match="'task.name': cannot import 'tests.nope:X'"):
        check_task(TaskConfig(name="tests.nope:X"))


def test_a_disabled_tool_answers_so_and_a_multi_turn_warm_start_trace_masks_the_replies():
    from meshrl.config import ModelConfig
    from meshrl.envs.rollout import ChatFormat
    from meshrl.loop.supervised import demonstration_tokens
    from meshrl.model.tokenizer import load_tokenizer

    prompt = Prompt("What is 12 * 34?", "408", {"expression": "12 * 34"})
    off = ToolEpisode(prompt, tools=[])
    assert (
        off.step("<calc>12 * 34</calc>").observation == " <result>error: calc is disabled</result> "
    )
    with pytest.raises(ConfigError, match="task.tools"):
        TaskConfig(name="calculator", tools=["abacus"]).validate()

    env = make_task(TaskConfig(name="calculator"))
    tok = load_tokenizer(ModelConfig())
    traces = {}
    while len(traces) < 2:  # one trace that calls the tool, one that answers at once
        ids, mask = demonstration_tokens(env, ChatFormat(tok), prompt)
        traces[1 if all(mask) else 2] = ids, mask
    ids, mask = traces[2]
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    masked = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert trained == "<calc>12 * 34</calc></s><answer>408</answer></s>"
    assert masked == " <result>408</result> "  # the episode's own reply, not trained on
    ids, mask = traces[1]
    assert tok.decode(ids) == "<answer>408</answer></s>" and all(mask)
