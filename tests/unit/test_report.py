"""`meshrl report` on a run's records: the held-out evaluation's rows and plot."""

import json
import os

import pytest

from meshrl.observe.report import plots, read_metrics, table

pytestmark = pytest.mark.unit


def test_held_out_sets_get_rows_and_a_plot(tmp_path):
    records = [{"step": s, "reward/mean": 0.1 * s} for s in range(4)]
    records[1].update({"eval/heldout/pass@1": 0.25, "eval/heldout/pass@4": 0.5})
    records[3].update({"eval/heldout/pass@1": 0.5, "eval/heldout/pass@4": 0.75})
    lines = table(records).splitlines()
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[1:]}
    assert rows["eval/heldout/pass@1"] == [0.25, 0.5, 0.25, 0.5]  # first, last, min, max
    assert rows["eval/heldout/pass@4"] == [0.5, 0.75, 0.5, 0.75]
    written = plots(records, str(tmp_path))
    assert os.path.join(str(tmp_path), "report_eval.png") in written


def test_throughput_is_tokens_over_step_time(tmp_path):
    lines = [{"step": 0, "tokens/generated": 300, "time/step_s": 1.5}, {"step": 1}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    records = read_metrics(str(tmp_path))
    assert records[0]["throughput/tokens_per_s"] == 200.0
    assert "throughput/tokens_per_s" not in records[1]
    assert os.path.join(str(tmp_path), "report_throughput.png") in plots(records, str(tmp_path))
