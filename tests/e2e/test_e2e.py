"""GRPO run as a user runs it: the CLI, the run directory, the trained model,
other placements, and Ctrl-C."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from algorithms.base import main
from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import load_config
from meshrl.loop import checkpoint
from meshrl.model.models import load_model
from tests.conftest import DEFAULT_CONFIG, REPO
from tests.support.runs import grpo_command, read_metrics, run_grpo

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


REQUIRED = [
    "step",
    "reward/mean",
    "tokens/generated",
    "weights/version",
    "time/step_s",
    "time/generate_s",
    "time/train_s",
    "time/weight_sync_s",
]


def test_cli_run_writes_everything_and_trains_every_parameter(tmp_path, no_stray_procs):
    result = run_grpo(
        tmp_path,
        "e2e",
        "steps=4",
        "warm_start.steps=2",
        "run.samples_every=2",
        "run.sinks=[tensorboard,wandb]",
        "placement.policy=2",
        "eval.every=0",  # the replicas' own counts below are the training batch's alone
        timeout=300,
        fresh=True,  # the command as a user types it, in a Python of its own
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "e2e"
    assert {"config.yaml", "metrics.jsonl", "warm_start.jsonl", "reward.png", "final"} <= set(
        os.listdir(run_dir)
    )
    assert len((run_dir / "warm_start.jsonl").read_text().splitlines()) == 2
    assert "grpo: 4 steps" in result.stdout
    # The console says what happened, and no expected noise: the summary names the
    # weights' path; the RDMA library's CUDA probe on this CPU host is filtered.
    summary = next(line for line in result.stdout.splitlines() if line.startswith("grpo: 4 steps"))
    assert "replicas' weights: 2 by shared memory" in summary
    assert "RdmaXcel" not in result.stdout + result.stderr

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records:
        for key in REQUIRED:
            assert key in record, key
        for key, value in record.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
    # warm-start publishes once more; each RL step advances the version by one
    versions = [r["weights/version"] for r in records]
    assert versions == list(range(versions[0], versions[0] + 4))
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in records)
    # The replica (same host: shared memory) samples from exactly the trainer's weights:
    # its log-probs and the trainer's recomputed ones agree to float32 rounding.
    assert all(r["weights/shm_replicas"] == 2 for r in records)
    assert all(r["sampling/logprob_abs_diff"] < 1e-4 for r in records), records

    # Metrics recorded inside the two policy replicas, reduced across them once a step.
    for r in records:
        assert r["policy/completion_tokens"] == r["tokens/generated"]  # sum
        assert r["policy/shortest_completion"] <= r["completion/mean_length"]  # min
        assert r["completion/mean_length"] <= r["policy/longest_completion"]  # max
        assert r["policy/entropy"] > 0 and r["time/policy/generate_s"] > 0  # mean, max
        assert "time/trainer/warm_start_step_s" not in r  # before the loop: no step's

    # Every 2 steps the whole batch's samples: prompt, completion, reward, advantage.
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [0, 2] and len(samples) == 2 * 16 * 8
    assert all(s["prompt"].endswith(">") and 0 <= s["reward"] <= 1 for s in samples)
    rewards = {r["step"]: r["reward/mean"] for r in records}
    assert abs(sum(s["reward"] for s in samples if s["step"] == 2) / 128 - rewards[2]) < 1e-6
    assert "step 2: 4 of 128 samples" in result.stdout  # the console table

    # The same figures in TensorBoard's event file, read back with its reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [e.step for e in scalars] == [0, 1, 2, 3]
    assert all(abs(e.value - rewards[e.step]) < 1e-6 for e in scalars)
    tokens = {r["step"]: r["policy/completion_tokens"] for r in records}
    assert {e.step: e.value for e in events.Scalars("policy/completion_tokens")} == tokens
    # W&B, offline: its run files, with the samples table among the logged media.
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    assert next(wandb_run.glob("run-*.wandb")).stat().st_size > 0
    assert list((wandb_run / "files" / "media" / "table").glob("samples_*.table.json"))

    # `meshrl report`: the installed command prints the key figures and draws the plots.
    meshrl = os.path.join(os.path.dirname(sys.executable), "meshrl")
    report = subprocess.run([meshrl, "report", str(run_dir)], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert "reward/mean" in report.stdout and "time/train_s" in report.stdout
    assert "time/policy/generate_s" in report.stdout
    for png in ("report_reward.png", "report_entropy.png", "report_length.png", "report_time.png"):
        assert (run_dir / png).stat().st_size > 0, png
    missing = subprocess.run([meshrl, "report", str(tmp_path)], capture_output=True, text=True)
    assert missing.returncode == 1 and "has no metrics.jsonl" in missing.stderr

    # `meshrl status`: every proc of the finished run, its actors and weight versions.
    status = subprocess.run([meshrl, "status", str(run_dir)], capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert "step 3" in lines[0] and "(exited)" in lines[0]
    last_version = str(records[-1]["weights/version"])
    for proc in ("policy[0]", "policy[1]"):
        (row,) = [line.split() for line in lines if line.startswith(proc)]
        assert row[1:4] == ["policy", "idle", last_version], row

    cfg = load_config(GRPOConfig, str(run_dir / "config.yaml"))
    assert cfg.steps == 4 and cfg.run.name == "e2e"
    initial = load_model(cfg.model, seed=cfg.run.seed)
    trained = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    initial_params = dict(initial.named_parameters())
    for name, param in trained.named_parameters():
        assert torch.isfinite(param).all(), name
        assert not torch.equal(param, initial_params[name]), f"{name} did not change"


def test_mesh_status_shows_a_killed_proc_dead(tmp_path, no_stray_procs):
    """The notebook view of the mesh: every proc alive with its actor's weight
    version, then a killed policy proc shown dead beside its live peers."""
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        ["warm_start.steps=0", "placement.policy=2", f"run.dir={tmp_path}", "run.name=status"],
    )
    algo = GRPO(cfg)
    try:
        algo.train(0)  # spawn the meshes; version 0 to both replicas
        deadline = time.monotonic() + 30
        while True:  # spawning is asynchronous: an actor shows once its __init__ is done
            procs = algo.mesh_status(show=False)
            if all(p["actors"] for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {(p["role"], p["rank"], p["state"]) for p in procs} == {
            ("policy", 0, "alive"),
            ("policy", 1, "alive"),
            ("trainer", 0, "alive"),
            ("environment", 0, "alive"),
        }
        versions = {a["actor"]: a["version"] for p in procs for a in p["actors"]}
        assert versions == {"policy": 0, "trainer": 0, "environment": None}
        algo.policy.slice(procs=1).exit_now.call_one()  # no reply: the proc exits
        deadline = time.monotonic() + 30
        while True:  # the view shows the proc dead once it is gone
            procs = algo.mesh_status(show=False)
            states = {(p["role"], p["rank"]): p["state"] for p in procs}
            if states[("policy", 1)] != "alive" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert states[("policy", 1)] == "dead"
        assert states[("policy", 0)] == states[("trainer", 0)] == "alive"
        from meshrl.observe.status import table

        (row,) = [line for line in table(procs).splitlines() if line.startswith("policy[1]")]
        assert "dead" in row
    finally:
        algo.close()


def test_reusing_a_run_name_is_refused(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.jsonl").write_text("{}\n")
    result = run_grpo(tmp_path, "taken", timeout=120)
    assert result.returncode == 1
    assert "already holds a run" in result.stderr
    assert (tmp_path / "taken" / "metrics.jsonl").read_text() == "{}\n"


def test_final_weights_do_not_depend_on_trainer_procs_or_colocation(tmp_path, no_stray_procs):
    """Same math at any placement, end to end: 3 steps of the token-mean loss with
    a KL term, the seed fixed and 2 policy replicas, run on 2 trainer procs that
    also hold the replicas (colocated) through the notebook path (config in
    code, run()), and on 1 trainer proc beside a policy mesh through the CLI's
    entry point, end at the same weights within 1e-4 relative (Adam amplifies
    reduction-order noise)."""
    overrides = [
        "steps=3",
        "warm_start.steps=0",
        "kl_coef=0.05",
        "loss_aggregation=token-mean",
        "placement.environment=2",
        "placement.reference=2",
        f"run.dir={tmp_path}",
        "run.progress=false",
    ]
    colocated = ["placement.trainer=2", "placement.colocate=true", "run.name=colocated"]
    cfg = load_config(GRPOConfig, DEFAULT_CONFIG, [*overrides, *colocated])
    history = GRPO(cfg).run()
    assert len(history) == 3
    assert all(r["weights/shm_replicas"] == 2 for r in history)  # a replica per trainer proc
    assert all(math.isfinite(r["policy/kl_ref"]) and r["policy/kl_ref"] >= 0 for r in history)
    assert history[0]["policy/kl_ref"] == pytest.approx(0.0, abs=1e-5)  # policy == reference
    assert history[-1]["weights/version"] == 3

    separate = ["placement.policy=2", "placement.trainer=1", "run.name=one"]
    assert main(GRPO, GRPOConfig, ["--config", DEFAULT_CONFIG, *overrides, *separate]) == 0
    one, two = (
        load_file(tmp_path / name / "final" / "model.safetensors") for name in ("one", "colocated")
    )
    start = load_model(cfg.model, cfg.run.seed).state_dict()
    assert max((two[k] - start[k]).norm() for k in two if k in start) > 1e-3  # the steps moved them
    assert one.keys() == two.keys()
    for key, want in two.items():
        error = ((one[key] - want).norm() / want.norm()).item()
        assert error < 1e-4, (
            f"{key}: relative difference {error:.2e}, 1 vs 2 colocated trainer procs"
        )


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_stops_the_run_and_every_proc(stop_signal, tmp_path, no_stray_procs):
    process = subprocess.Popen(
        # A checkpoint every 100000 steps: none is due until the stop asks for one.
        grpo_command(
            tmp_path,
            "interrupted",
            "steps=100000",
            "warm_start.steps=0",
            "checkpoint.every=100000",
            fresh=True,  # a fresh Python, in this process's group as in a terminal
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A background shell starts children with SIGINT ignored; a user's terminal does not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert process.poll() is None, process.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "run did not start stepping"
            time.sleep(0.2)
        process.send_signal(stop_signal)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr[-2000:]
    assert "interrupted: stopped after" in stderr
    # The step under way finished; what was logged is intact, and a checkpoint of
    # exactly those steps was written on the way out.
    lines = metrics.read_text().splitlines()
    assert all(json.loads(line)["step"] == i for i, line in enumerate(lines))
    saved = checkpoint.latest(str(tmp_path / "interrupted"))
    assert saved is not None and checkpoint.step_of(saved) == len(lines), stderr[-2000:]


def test_lora_trains_adapters_and_exports_merged_and_adapter(tmp_path, no_stray_procs):
    """model.lora: only the adapters train; replicas sample from the merged weights
    (their log-probs match the trainer's adapter forward); the final model is saved
    merged (plain HF) and as a peft adapter, and the two agree."""
    from peft import PeftModel

    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            "steps=3",
            "warm_start.steps=0",
            "model.lora.rank=4",
            "model.lora.save=both",
            "checkpoint.every=3",
            f"run.dir={tmp_path}",
            "run.name=lora",
            "run.progress=false",
        ],
    )
    history = GRPO(cfg).run()
    assert all(r["sampling/logprob_abs_diff"] < 1e-4 for r in history)
    final = tmp_path / "lora" / "final"
    merged = dict(AutoModelForCausalLM.from_pretrained(final).named_parameters())
    initial = load_model(cfg.model, seed=cfg.run.seed)
    for name, param in initial.named_parameters():
        adapted = any(f".{m}." in name for m in cfg.model.lora.target_modules)
        assert torch.equal(param, merged[name]) != adapted, name  # only adapted layers moved
    unmerged = PeftModel.from_pretrained(initial, final / "adapter").merge_and_unload()
    for name, param in unmerged.named_parameters():
        assert (param - merged[name]).abs().max().item() < 1e-6, name
    # The last step's checkpoint exported after the fact: the same merged model.
    from meshrl.loop.export import export_checkpoint

    export_checkpoint(str(tmp_path / "lora"), str(tmp_path / "exported"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert all(torch.equal(p, merged[n]) for n, p in exported.named_parameters())
    assert (tmp_path / "exported" / "adapter" / "adapter_config.json").is_file()
