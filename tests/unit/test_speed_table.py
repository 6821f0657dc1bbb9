"""README's speed table is rendered from saved benchmark JSON (benchmarks/speed.py):
rows from made-up records, the rows without one, the rewrite between the markers,
and the one error a broken file gives. Runs no benchmark."""

import json
import os

import pytest

from benchmarks.speed import END, HEADER, ROWS, RULE, START, SpeedError, render_table, rewrite
from tests.conftest import REPO

pytestmark = pytest.mark.unit

PROC_START = {
    "procs": 4,
    "rounds": 3,
    "cores": 2,
    "ready_s": {"fresh": 10.0, "forked": 0.5, "ratio_forked_over_fresh": 0.05},
    "respawn_s": {"fresh": 12.345, "forked": 3.0, "ratio_forked_over_fresh": 0.243},
    "proc_cpu_s": {"fresh": 6.0, "forked": 0.2, "ratio_forked_over_fresh": 0.033},
    "server_start_s": 8.0,
}
GENERATION = {
    "params": 4246784,
    "G8_plain_tokens_per_s": 1000.4,
    "G8_both_tokens_per_s": 2500.5,
    "G8_speedup": 2.5,
    "G16_plain_tokens_per_s": 1200.0,
    "G16_both_tokens_per_s": 3000.0,
    "G16_speedup": 2.5,
    "prompts": 8,
    "prompt_tokens": 128,
    "tokens_equal": True,
}


def record(row: str, result: dict, commit: str, machine: str = "Linux, 2 cores (CPU X)") -> dict:
    return {
        "row": row,
        "command": f"python benchmarks/{row}.py",
        "commit": commit,
        "date": "2026-12-01T10:00:00Z",
        "machine": machine,
        "result": result,
    }


def write(data_dir, name: str, obj) -> str:
    path = os.path.join(data_dir, f"{name}.json")
    with open(path, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_rows_render_from_saved_records_and_the_rest_say_not_measured(tmp_path):
    write(tmp_path, "proc_start", record("proc_start", PROC_START, "abc1234"))
    write(tmp_path, "generation", record("generation", GENERATION, "abc1234"))
    lines = render_table(str(tmp_path), head="fff0000").splitlines()

    assert lines[:3] == [START, HEADER, RULE] and lines[-1] == END
    rows = {row.name: line for row, line in zip(ROWS, lines[3:], strict=False)}
    assert rows["proc_start"] == (
        "| `proc_start.py`, a `local` mesh of 4 procs importing the policy actor, until every "
        "proc answers | forked from the fork server 0.50 s; a lost proc serving again 3.00 s "
        "| fresh Pythons 10.00 s (0.05×); respawn 12.35 s (0.24×) |"
    )
    assert rows["generation"] == (
        "| `generation.py`, sampler, 8 prompts of 128 tokens, G = 8 / 16, 4.2M Llama "
        "| shared prefill + dropped rows: 2,500 / 3,000 tokens/s "
        "| plain 1,000 / 1,200 tokens/s (2.50× / 2.50×), same tokens |"
    )
    assert rows["fanout"] == (
        "| `fanout.py`, 64 MB to 16 replicas on `process` hosts | not measured yet at fff0000 "
        '| `make speed ARGS="--only fanout"` |'
    )
    assert len(lines) == 3 + len(ROWS) + 3  # the rows, a blank line, the stamp, the end marker
    stamp = lines[-2]
    assert "proc_start, generation at commit abc1234 on 2026-12-01" in stamp
    assert stamp.endswith(
        "on Linux, 2 cores (CPU X). Not measured yet: "
        + ", ".join(row.name for row in ROWS if row.name not in ("proc_start", "generation"))
        + "."
    )


def test_prefix_training_renders_its_layouts_and_its_cells():
    from benchmarks.speed import prefix_training

    common = {"prompts": 1, "group": 8, "prompt_tokens": 512, "params": 1234567}
    layouts = {
        **common,
        "completion_tokens": 64,
        "padded_step_s": 4.0,
        "packed_step_s": 4.2,
        "tree_step_s": 1.0,
        "speedup_tree": 4.0,
    }
    assert prefix_training({"result": layouts})[1] == "`trainer.layout: tree` 1.00 s"
    cell = {"padded_step_s": 2.0, "tree_step_s": 1.5, "padded_peak_mb": 900.4}
    cells = {
        **common,
        "c1024": {**cell, "tree_peak_mb": 800.0},
        "c4096": cell | {"tree_step_s": 2.0, "tree_peak_mb": 700.0},
    }
    title, tree, padded = prefix_training({"result": cells})
    assert title.endswith("1 prompt of 512 tokens × 8 completions of 1024 / 4096, 1.2M Llama")
    assert tree == "`trainer.layout: tree` 1.50 s, 800 MB / 2.00 s, 700 MB"
    assert padded == "padded 2.00 s, 900 MB / 2.00 s, 900 MB (tree ÷ padded: 0.75 / 1.00)"


def test_rows_from_other_commits_and_machines_say_each(tmp_path):
    write(tmp_path, "proc_start", record("proc_start", PROC_START, "abc1234", "machine A"))
    write(tmp_path, "generation", record("generation", GENERATION, "def5678", "machine B"))
    stamp = render_table(str(tmp_path), head="fff0000").splitlines()[-2]
    assert "proc_start at commit abc1234 on 2026-12-01 (machine A)" in stamp
    assert "generation at commit def5678 on 2026-12-01 (machine B)" in stamp


def test_the_rewrite_touches_only_the_marked_block():
    before = "# Title\n\nSome text | with a pipe.\n\n"
    after = "\n\n## Next\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    text = before + START + "\n| old | table |\n" + END + after
    block = START + "\nnew\n" + END
    assert rewrite(text, block) == before + block + after
    with pytest.raises(SpeedError, match="needs one"):
        rewrite(before + after, block)


@pytest.mark.parametrize(
    "content,says",
    [
        ('{"row": "fanout", "commit": ', "not readable as JSON"),
        ('["a list"]', "a JSON object"),
        (json.dumps({"row": "fanout", "result": {}}), "needs command, commit, date, machine"),
        (json.dumps(record("fanout", {"star": []}, "abc1234")), "the fanout row cannot be"),
    ],
)
def test_a_broken_file_is_one_error_naming_it(tmp_path, content, says):
    path = write(tmp_path, "fanout", content)
    with pytest.raises(SpeedError, match=says) as caught:
        render_table(str(tmp_path), head="fff0000")
    assert str(caught.value).startswith(f"{path}: ")


def test_readme_holds_the_generated_table():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert text.count(START) == 1 and text.count(END) == 1
    lines = text.split(START)[1].split(END)[0].strip().splitlines()
    assert lines[:2] == [HEADER, RULE]
    for row, line in zip(ROWS, lines[2:], strict=False):
        assert line.startswith(f"| {row.title}"), (row.name, line)
    assert lines[-1].startswith("Generated by `make speed`")
