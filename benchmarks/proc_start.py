"""Proc start: seconds from asking for a mesh to its first answer, with every
proc a fresh Python against every proc a fork of the fork server
(`job.fork_server`, `meshrl.procs.zygote`), in one run of this script.

    python benchmarks/proc_start.py               # 4 procs, 3 rounds
    python benchmarks/proc_start.py --procs 2 --rounds 5

Each round, for each way in turn (the order alternates), spawns a `local` mesh
of `--procs` procs whose actor imports the policy actor's module (torch,
transformers, meshrl's modelling code), waits for every proc's answer, then
kills one proc and times `RoleMeshes.respawn` until the new proc answers (what
a run pays to replace a lost policy or environment proc). Prints one JSON line:
- `ready_s` / `respawn_s`: the median over the rounds, per way, and the ratio
  forked / fresh;
- `proc_cpu_s`: CPU seconds each proc spent before it answered (median);
- `server_start_s`: what starting the fork server took, once per controller
  (not in `ready_s`: a run pays it once, however many procs it spawns).

On this machine's 2 cores, fresh procs importing at once share the cores; a
host with more cores starts them more in parallel, the fork server as well.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from monarch.actor import Actor, endpoint  # noqa: E402

from meshrl.procs import zygote  # noqa: E402
from meshrl.procs.job import JobConfig  # noqa: E402
from meshrl.procs.mesh import RoleMeshes, wait  # noqa: E402
from meshrl.procs.proc_pool import alive  # noqa: E402


class Loaded(Actor):
    """Imports what a policy proc imports before it can answer."""

    def __init__(self) -> None:
        import actors.policy  # noqa: F401

    @endpoint
    def ready(self) -> tuple[int, float]:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return os.getpid(), (int(fields[11]) + int(fields[12])) / ticks


def one_round(procs: int, forked: bool) -> dict:
    started = time.monotonic()
    with RoleMeshes({"policy": procs}, job=JobConfig(fork_server=forked)) as meshes:
        actors = meshes.spawn("policy", "loaded", Loaded)
        answers = [a for _, a in wait(actors.ready.call(), "policy.ready", 600).items()]
        ready_s = time.monotonic() - started
        os.kill(answers[0][0], signal.SIGKILL)
        while alive(answers[0][0]):
            time.sleep(0.01)
        started = time.monotonic()
        meshes.respawn("policy")
        actors = meshes.spawn("policy", "loaded", Loaded)
        wait(actors.ready.call(), "policy.ready", 600)
        respawn_s = time.monotonic() - started
    return {
        "ready_s": ready_s,
        "respawn_s": respawn_s,
        "proc_cpu_s": statistics.median(cpu for _, cpu in answers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    started = time.monotonic()
    zygote.server()
    server_start_s = time.monotonic() - started
    rounds: dict[str, list[dict]] = {"fresh": [], "forked": []}
    for i in range(args.rounds):
        order = ("fresh", "forked") if i % 2 == 0 else ("forked", "fresh")
        for way in order:
            rounds[way].append(one_round(args.procs, way == "forked"))
    result: dict = {"procs": args.procs, "rounds": args.rounds, "cores": os.cpu_count()}
    for key in ("ready_s", "respawn_s", "proc_cpu_s"):
        fresh, forked = (statistics.median(r[key] for r in rounds[w]) for w in ("fresh", "forked"))
        result[key] = {"fresh": round(fresh, 3), "forked": round(forked, 3)}
        result[key]["ratio_forked_over_fresh"] = round(forked / fresh, 3)
    result["server_start_s"] = round(server_start_s, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
