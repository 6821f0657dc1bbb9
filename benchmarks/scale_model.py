"""The scale model: weight distribution and the controller's step cost, calibrated
to `benchmarks/fanout.py` and `benchmarks/controller_scale.py`, extrapolated to
large models and many replicas. docs/scale.md explains it.

    python benchmarks/scale_model.py        # from the shipped measurements
    python benchmarks/scale_model.py --fanout-json F --controller-json C --link-gbps 400

The two JSON files are the benchmarks' last lines (benchmarks/data/ holds the
ones measured on the 2-core CPU machine that docs/scale.md quotes).

Calibrated here, from the measurements:
- `hop_s`: what one level of a relay tree adds beyond moving its bytes (the
  relay's slot copy, the call round trips), from relay minus star sync time at
  equal bytes moved (on that machine every byte shares the same 2 cores, so
  star and relay move N copies at the same aggregate rate);
- `controller_s_per_replica` and `controller_s_fixed`: the controller's CPU
  seconds per step, fitted linear in N (the star);
- `controller_s_per_level`: what each relay level adds to the step (its
  sequential round trips), from relay minus star overhead over the extra levels.

Predicted, per model size and replica count, star against relay at
`--fanout`, for a link of `--link-gbps` per host:
- `trainer_egress_bytes`: N x model bytes (star), fanout x model bytes (relay);
- `sync_s`: the star is bound by the trainer hosts' egress, N B / (T W); the
  relay by its levels, each a sender pushing `fanout` copies through its own
  hosts' links, f B / (g W), plus the relay's copy of what it pulled into the
  slots it serves from, B / (g C), plus `hop_s` (store and forward: a level
  starts when the one above is done). Also the pipelined relay (not built:
  chunks forwarded as they arrive), f B / (g W) + depth x hop_s;
- `controller_s`: fixed + N x per replica (+ depth x per level, relay).
B is the model's bf16 bytes, T the trainer's hosts and g the hosts of one
replica (its tensor-parallel group), as in the ASSUMPTIONS table; W the link
and C the copy rate into the served slots per host (`--copy-gbps`: GPU to
host memory, 8 GPUs x about 25 GB/s of PCIe).
Prints the calibration, the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

ASSUMPTIONS = {
    # params, trainer hosts (T), hosts per replica (g): 8 GPUs a host.
    "8B": {"params": 8e9, "trainer_hosts": 1, "replica_hosts": 1},
    "70B": {"params": 70e9, "trainer_hosts": 8, "replica_hosts": 2},
    "1T": {"params": 1e12, "trainer_hosts": 64, "replica_hosts": 16},
}
REPLICAS = (64, 1_000, 10_000)
BYTES_PER_PARAM = 2  # bf16


def levels(replicas: int, fanout: int) -> int:
    """Depth of the complete fanout-ary tree of `meshrl.loop.weight_sync.plan`."""
    if fanout <= 1:
        return replicas
    depth, reached, width = 0, 0, 1
    while reached < replicas:
        width *= fanout
        reached += width
        depth += 1
    return depth


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def calibrate(fanout_run: dict, controller_run: dict) -> dict:
    star = {r["replicas"]: r for r in fanout_run["star"]}
    relay = {r["replicas"]: r for r in fanout_run["relay"]}
    extra = [
        (relay[n]["sync_s"] - star[n]["sync_s"]) / (relay[n]["max_hop_depth"] - 1)
        for n in relay
        if relay[n]["max_hop_depth"] > 1
    ]
    hop_s = max(0.0, sum(extra) / len(extra)) if extra else 0.0
    one = min(relay, key=lambda n: n)
    rate = fanout_run["model_bytes"] / relay[one]["sync_s"]  # one stream, this machine
    cs_star = controller_run["star"]
    fixed, per_replica = fit_line(
        [r["replicas"] for r in cs_star], [r["controller_cpu_s"] for r in cs_star]
    )
    per_level = [
        (b["overhead_s"] - a["overhead_s"]) / (b["max_hop_depth"] - 1)
        for a, b in zip(cs_star, controller_run["relay"], strict=True)
        if b["max_hop_depth"] > 1
    ]
    return {
        "hop_s": round(hop_s, 4),
        "stream_bytes_per_s_measured": round(rate),
        "controller_s_fixed": round(max(0.0, fixed), 5),
        "controller_s_per_replica": round(per_replica, 6),
        "controller_s_per_level": round(max(0.0, sum(per_level) / len(per_level)), 5)
        if per_level
        else 0.0,
    }


def predict(cal: dict, link_bytes_per_s: float, copy_bytes_per_s: float, fanout: int) -> list[dict]:
    rows = []
    for name, spec in ASSUMPTIONS.items():
        model_bytes = spec["params"] * BYTES_PER_PARAM
        trainer_bw = spec["trainer_hosts"] * link_bytes_per_s
        replica_bw = spec["replica_hosts"] * link_bytes_per_s
        for n in REPLICAS:
            depth = levels(n, fanout)
            first = fanout * model_bytes / trainer_bw  # the trainer sends fanout copies
            below = fanout * model_bytes / replica_bw  # a relay sends fanout copies
            copy = model_bytes / (spec["replica_hosts"] * copy_bytes_per_s)  # into its slots
            controller = cal["controller_s_fixed"] + n * cal["controller_s_per_replica"]
            rows.append(
                {
                    "model": name,
                    "replicas": n,
                    "model_bytes": model_bytes,
                    "star_sync_s": round(n * model_bytes / trainer_bw + cal["hop_s"], 2),
                    "relay_sync_s": round(
                        first + (depth - 1) * (below + copy) + depth * cal["hop_s"], 2
                    ),
                    "relay_pipelined_sync_s": round(max(first, below) + depth * cal["hop_s"], 2),
                    "relay_depth": depth,
                    "star_egress_bytes": n * model_bytes,
                    "relay_egress_bytes": fanout * model_bytes,
                    "star_controller_s": round(controller, 3),
                    "relay_controller_s": round(
                        controller + depth * cal["controller_s_per_level"], 3
                    ),
                }
            )
    return rows


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.0f} EB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fanout-json", default=os.path.join(HERE, "data", "fanout.json"))
    parser.add_argument(
        "--controller-json", default=os.path.join(HERE, "data", "controller_scale.json")
    )
    parser.add_argument("--link-gbps", type=float, default=400.0)
    parser.add_argument("--copy-gbps", type=float, default=1600.0, help="per host")
    parser.add_argument("--fanout", type=int, default=None, help="default: the measured run's")
    args = parser.parse_args()
    with open(args.fanout_json) as f:
        fanout_run = json.load(f)
    with open(args.controller_json) as f:
        controller_run = json.load(f)
    fanout = args.fanout or fanout_run["fanout"]
    cal = calibrate(fanout_run, controller_run)
    rows = predict(cal, args.link_gbps * 1e9 / 8, args.copy_gbps * 1e9 / 8, fanout)
    print(f"calibration: {cal}")
    print(
        f"link {args.link_gbps:g} Gb/s and slot copies {args.copy_gbps:g} Gb/s per host, "
        f"fanout {fanout}, bf16\n"
    )
    head = (
        "model",
        "N",
        "star sync",
        "relay sync",
        "pipelined",
        "depth",
        "star egress",
        "relay egress",
        "ctrl star",
        "ctrl relay",
    )
    print(" | ".join(head))
    for r in rows:
        print(
            f"{r['model']} | {r['replicas']} | {r['star_sync_s']:g} s | {r['relay_sync_s']:g} s"
            f" | {r['relay_pipelined_sync_s']:g} s | {r['relay_depth']}"
            f" | {human_bytes(r['star_egress_bytes'])} | {human_bytes(r['relay_egress_bytes'])}"
            f" | {r['star_controller_s']:g} s | {r['relay_controller_s']:g} s"
        )
    print(
        json.dumps(
            {
                "calibration": cal,
                "link_gbps": args.link_gbps,
                "copy_gbps": args.copy_gbps,
                "fanout": fanout,
                "assumptions": ASSUMPTIONS,
                "predictions": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
