"""Does tool latency hide behind generation? 64 four-turn episodes whose every
tool call sleeps 100 ms, on the real policy and environment meshes.

    python benchmarks/rollout_latency.py
    python benchmarks/rollout_latency.py --episodes 128 --latency 0.2 placement.policy=2

Measured in one run, on the same actors:
- wall_s: the 64 episodes with the 100 ms tool (best of --repeats).
- generation_s: the same episodes with a 0 ms tool, so what is left is
  generation and the rollout's own overhead (best of --repeats).
- serial_s: generation_s plus every tool call one after another
  (episodes x turns x latency): no overlap at all.
- ideal_s: generation_s plus one episode's tool latency (turns x latency):
  perfect overlap.
Prints a table, then as its last line a JSON object with wall_s, serial_s,
ideal_s and ratio_to_ideal (goal: <= 1.5).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO  # noqa: E402
from benchmarks.common import arguments  # noqa: E402
from benchmarks.pins import grpo_config  # noqa: E402


def main() -> int:
    parser = arguments(__doc__, episodes=64, turns=4, latency=0.1, repeats=3)
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = grpo_config(
            "task.name=slow_tool",
            f"task.max_turns={args.turns}",
            f"task.env_workers={args.episodes}",
            "group_size=2",
            f"prompts_per_step={args.episodes // 2}",
            "warm_start.steps=0",
            "generation.max_new_tokens=8",
            *args.overrides,
            f"run.dir={run_dir}",
            "run.name=latency",
            "run.progress=false",
        )
        algo = GRPO(cfg)
        try:
            algo.train(0)  # spawn the meshes, version 0 on the replicas
            rng = random.Random(0)

            def play(latency: float) -> float:
                prompts = algo.task.sample(args.episodes // 2, rng)  # 2 episodes each
                for p in prompts:
                    p.data = {"latency_s": latency}
                started = time.perf_counter()
                _, _, info = algo.collector.play(prompts)
                assert info["episodes/turns_mean"] == args.turns, info
                assert len(algo.last_episodes) == args.episodes
                return time.perf_counter() - started

            play(0.0)  # warm-up
            generation = min(play(0.0) for _ in range(args.repeats))
            wall = min(play(args.latency) for _ in range(args.repeats))
        finally:
            algo.close()
    one_episode = args.turns * args.latency
    serial = generation + args.episodes * one_episode
    ideal = generation + one_episode
    print(f"{args.episodes} episodes x {args.turns} turns, tool latency {args.latency * 1e3:g} ms")
    print(f"  generation only (0 ms tool)   {generation:8.3f} s")
    print(f"  wall (with the tool)          {wall:8.3f} s")
    print(f"  serial (no overlap)           {serial:8.3f} s   wall is {serial / wall:.1f}x faster")
    print(f"  ideal (one episode's latency) {ideal:8.3f} s   wall / ideal = {wall / ideal:.2f}")
    result = {
        "episodes": args.episodes,
        "turns": args.turns,
        "latency_s": args.latency,
        "generation_s": round(generation, 4),
        "wall_s": round(wall, 4),
        "serial_s": round(serial, 4),
        "ideal_s": round(ideal, 4),
        "ratio_to_ideal": round(wall / ideal, 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
