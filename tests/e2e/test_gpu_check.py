"""`make gpu-check`'s script (benchmarks/gpu_check.py) on this machine's CPU, with
short horizons: every check but vLLM's runs, so that the script cannot rot between
the GPU hosts it is meant for."""

import json
import subprocess

import pytest

from meshrl.procs import zygote
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_every_gpu_check_runs_on_the_cpu(no_stray_procs):
    done = subprocess.run(
        zygote.python_m("benchmarks.gpu_check", "--quick"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and result["ok"], (result, done.stderr[-3000:])
    assert result["device"] == "cpu" and result["skipped"] == ["vllm"]
    assert "CUDA" in result["checks"]["vllm"]["skipped"]
    checks = result["checks"]
    assert set(result["ran"]) == set(checks) - {"vllm"}
    assert checks["model"]["logprob_gap"] < 1e-4 and checks["tree_layout"]["gap"] < 1e-4
    assert checks["weight_sync"]["delta_bytes"] < checks["weight_sync"]["full_bytes"] / 8
    assert checks["routing_replay"]["ran_mismatch"] == 0
    assert checks["distributed"]["backend"] == "gloo"
    assert checks["grpo"]["steps"] == 3 and checks["grpo"]["tokens_per_s"] > 0
    assert checks["grpo"]["resumed_at"] == 2 and checks["grpo"]["resume_equal"]
    assert checks["checkpoint"]["optimizer_tensors"] > 0
    assert checks["vision"]["qwen2_vl_logprob_gap"] < 1e-4
    assert checks["continuous"]["calls_equal"] == checks["continuous"]["calls"] == 6
    assert checks["continuous"]["rows_spanning_versions"] > 0
    assert checks["partial"]["steps"] == 3 and checks["partial"]["partial_rows"] > 0
