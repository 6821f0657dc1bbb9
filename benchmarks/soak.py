"""Soak: a long PPO run (policy, environment, reference, critic and trainer meshes)
with random faults of every kind, and the sample accounting at the end.

    python benchmarks/soak.py                       # 300 steps, 24 faults
    python benchmarks/soak.py --steps 1000 --faults 80 --seed 3
    python benchmarks/soak.py --algo grpo           # no critic
    python benchmarks/soak.py --standby --algo grpo --steps 80 --faults 16
    python benchmarks/soak.py --dispatch pull --staleness 1   # work by pull, one version ahead

Each fault is a drill from the `faults:` config, at a random step after the
first checkpoint: a proc of a random role killed (`faults.kill`), or a random
drillable endpoint made to raise on every proc of its role (`faults.raise_in`,
retried once). Prints the faults injected and recovered, the samples
generated, trained, dropped and redone (by reason), and any sample unaccounted for
("lost"), then one JSON object of the figures as its last line.

`--standby` runs it twice with the same schedule of kills, of policy and
environment procs only: without standbys, then with one standby proc for each
(`faults.standby`). Its JSON line adds the p50/p95 of the seconds from a kill
to seeing it (`detect_*`, both runs) and to serving again (`serve_again_*`).

A lost trainer or critic rank is healed from its peer (DDP: the ranks are
replicas): the figures give the p50/p95 seconds of a heal (`heal_p50_s`,
`heal_p95_s`: a survivor's state staged, the procs replaced, the state read)
and from the kill to serving again (`heal_serve_again_p50_s`, `..._p95_s`).

Each soak also runs its fault-free twin, the same config and seed with no drill
(`--no-twin` skips it), and says whether the run with faults ended with the twin's
parameters bit for bit (`final_params_equal_fault_free`) and logged the twin's
metrics at every step but the fault counters, sample accounting and timings
(`metrics_equal_fault_free`).

Not part of `make test` (it takes minutes); `make soak` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO, GRPOConfig  # noqa: E402
from algorithms.ppo import PPO, PPOConfig  # noqa: E402
from benchmarks.pins import UNMEASURED  # noqa: E402
from meshrl.config import load_config  # noqa: E402
from meshrl.procs.faults import DRILLED_ENDPOINTS  # noqa: E402

PLACEMENT = {"policy": 2, "environment": 2, "trainer": 2, "reference": 1, "critic": 2}
"""Two DDP ranks of trainer and critic: a lost one is healed from the other."""


def fault_schedule(
    rng: random.Random,
    steps: int,
    count: int,
    first: int,
    roles: list[str],
    kill_share: float = 0.5,
) -> tuple[list[str], list[str]]:
    """`count` drills at distinct random steps in [first, steps): (kill, raise_in)."""
    kills, raises = [], []
    for step in sorted(rng.sample(range(first, steps), count)):
        role = rng.choice(roles)
        if rng.random() < kill_share:
            kills.append(f"{role}:{rng.randrange(PLACEMENT[role])}@{step}")
        else:
            raises.append(f"{role}.{rng.choice(DRILLED_ENDPOINTS[role])}@{step}")
    return kills, raises


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", choices=("ppo", "grpo"), default="ppo")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--faults", type=int, default=24)
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staleness", type=int, default=0, help="max_staleness")
    parser.add_argument("--dispatch", choices=("split", "pull"), default="split")
    parser.add_argument("--run-dir", default=None, help="default: a temporary directory")
    parser.add_argument(
        "--no-twin", dest="twin", action="store_false", help="skip the fault-free twin run"
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="run it twice with the same kills of policy and environment procs, without "
        "and with a standby for each, and compare the times to detect a loss and to "
        "serve again",
    )
    args = parser.parse_args()
    twin = soak(args, standby=0, drills=False)[0] if args.twin else None
    if not args.standby:
        figures, _ = soak(args, standby=0, twin=twin)
        print(json.dumps(figures))
        return 0 if figures["samples_lost"] == 0 and figures["steps"] == args.steps else 1
    cold, cold_times = soak(args, standby=0, twin=twin)
    warm, warm_times = soak(args, standby=1, twin=twin)
    figures = {
        **{f"cold_{k}": v for k, v in cold.items()},
        **{f"standby_{k}": v for k, v in warm.items()},
        "detect_p50_s": percentile([t["detect_s"] for t in cold_times + warm_times], 50),
        "detect_p95_s": percentile([t["detect_s"] for t in cold_times + warm_times], 95),
        "serve_again_p50_s_cold": percentile([t["serve_s"] for t in cold_times], 50),
        "serve_again_p95_s_cold": percentile([t["serve_s"] for t in cold_times], 95),
        "serve_again_p50_s_standby": percentile([t["serve_s"] for t in warm_times], 50),
        "serve_again_p95_s_standby": percentile([t["serve_s"] for t in warm_times], 95),
        "recoveries_timed": [len(cold_times), len(warm_times)],
    }
    print(json.dumps(figures))
    lost = cold["samples_lost"] + warm["samples_lost"]
    return 0 if lost == 0 and cold["steps"] == warm["steps"] == args.steps else 1


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of `values`, rounded; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))], 3)


def soak(
    args: argparse.Namespace, standby: int, drills: bool = True, twin: dict | None = None
) -> tuple[dict, list[dict]]:
    """One soak run (`drills` False: the fault-free twin); its figures and the timed
    recoveries of the elastic roles. With `twin` (the twin's figures), the figures say
    whether this run ended where the twin did."""

    roles = ["policy", "environment", "reference", "trainer"]
    if args.algo == "ppo":
        roles.append("critic")
        algorithm, schema, config = PPO, PPOConfig, "ppo.yaml"
    else:
        algorithm, schema, config = GRPO, GRPOConfig, "grpo_default.yaml"
    if args.standby:  # procs the standbys stand in for, killed (the same ones in both runs)
        roles = ["policy", "environment"]
    kills, raises = fault_schedule(
        random.Random(args.seed),
        args.steps,
        args.faults,
        args.every,
        roles,
        1.0 if args.standby else 0.5,
    )
    if not drills:
        kills, raises = [], []
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="meshrl-soak-")
    overrides = [
        *UNMEASURED,  # the checkpoint cadence is set below: it is part of what is measured
        f"steps={args.steps}",
        "kl_coef=0.01",
        f"max_staleness={args.staleness}",
        f"rollout.dispatch={args.dispatch}",
        *(f"placement.{role}={n}" for role, n in PLACEMENT.items()),
        f"checkpoint.every={args.every}",
        f"faults.kill=[{','.join(kills)}]",
        f"faults.raise_in=[{','.join(raises)}]",
        "faults.retry_errors=1",
        f"faults.max_recoveries={args.faults + 1}",
        f"run.dir={run_dir}",
        f"run.name=soak-{args.algo}-{args.seed}-" + (f"standby{standby}" if drills else "twin"),
        "run.progress=false",
        f"run.save_final={'true' if args.twin else 'false'}",
        f"faults.standby.policy={standby}",
        f"faults.standby.environment={standby}",
    ]
    if args.algo == "grpo":
        overrides.append("prompts_per_step=16")
    cfg = load_config(schema, os.path.join(REPO, "algorithms", "configs", config), overrides)
    algo = algorithm(cfg)
    started = time.perf_counter()
    history = algo.run()
    wall = time.perf_counter() - started

    last, ledger = history[-1], algo.state.ledger
    dropped = dict(sorted(ledger.dropped.items()))
    # From the ledger, which also holds what the run's end dropped (under pull: the
    # groups generated ahead, never trained), after the last step's record.
    lost = ledger.generated - ledger.trained - sum(dropped.values())
    recovered = Counter(r.split(":")[0] for r in algo.state.recoveries)
    rewards = [r["reward/mean"] for r in history]
    heals = [t for t in algo.sup.recovery_times if "heal_s" in t]
    figures = {
        "algo": args.algo,
        "max_staleness": args.staleness,
        "dispatch": args.dispatch,
        "steps": len(history),
        "steps_planned": args.steps,
        "faults_injected": len(kills) + len(raises),
        "kills_injected": len(kills),
        "raises_injected": len(raises),
        "procs_recovered": sum(recovered.values()),
        "recovered_by_role": dict(recovered),
        "errors_retried": last["faults/errors_retried"],
        "samples_generated": ledger.generated,
        "samples_trained": ledger.trained,
        "samples_dropped": dict(dropped),
        "samples_redone": dict(sorted(algo.state.ledger.redone.items())),
        "samples_lost": lost,
        "heals": len(heals),
        "heal_p50_s": percentile([t["heal_s"] for t in heals], 50),
        "heal_p95_s": percentile([t["heal_s"] for t in heals], 95),
        "heal_serve_again_p50_s": percentile([t["serve_s"] for t in heals], 50),
        "heal_serve_again_p95_s": percentile([t["serve_s"] for t in heals], 95),
        "reward_first10": sum(rewards[:10]) / len(rewards[:10]),
        "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]),
        "wall_s": round(wall, 1),
    }
    if twin is not None:
        figures.update(same_as_twin(algo.run_dir, history, twin["run_dir"]))
    figures["run_dir"] = algo.run_dir
    print()
    print(
        f"soak: {args.algo}, {args.steps} steps, seed {args.seed}, standby {standby}, "
        f"run dir {algo.run_dir}"
    )
    print(f"  kills     {', '.join(kills) or '-'}")
    print(f"  raise_in  {', '.join(raises) or '-'}")
    print(f"{'figure':<31}{'value':>12}")
    for key, value in figures.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
        elif isinstance(value, float):
            value = f"{value:.3f}"
        print(f"{key:<31}{value!s:>12}")
    times = [t for t in algo.sup.recovery_times if t["role"] in ("policy", "environment")]
    figures["serve_again_s"] = [round(t["serve_s"], 2) for t in times]
    return figures, times


def same_as_twin(run_dir: str, history: list[dict], twin_dir: str) -> dict:
    """Whether a run ended with its fault-free twin's parameters, bit for bit, and
    logged the twin's metrics at every step but `faults/`, `samples/` and `time/`."""
    from safetensors.torch import load_file

    final = load_file(os.path.join(run_dir, "final", "model.safetensors"))
    twin_final = load_file(os.path.join(twin_dir, "final", "model.safetensors"))
    with open(os.path.join(twin_dir, "metrics.jsonl")) as f:
        expected = [json.loads(line) for line in f]
    plain = ("time/", "samples/", "faults/")

    def kept(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith(plain)}

    differ = [
        i for i, (a, b) in enumerate(zip(history, expected, strict=False)) if kept(a) != kept(b)
    ]
    return {
        "final_params_equal_fault_free": final.keys() == twin_final.keys()
        and all(final[k].equal(twin_final[k]) for k in final),
        "metrics_equal_fault_free": len(history) == len(expected) and not differ,
        "first_step_differing": differ[0] if differ else None,
    }


if __name__ == "__main__":
    sys.exit(main())
