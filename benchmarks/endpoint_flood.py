"""Does a flood of abusive requests to the policy endpoint slow the run that
serves it? GRPO trains with `policy.serve_port` open; the same run's steps are
timed without a flood, then while another process (16 client threads) sends at
least 500 requests the endpoint must refuse (300 MB bodies, 5 MB prompts, malformed JSON, unknown
models, subnormal temperatures, guessed episode URLs) and 100 connections sit
idle.

    python benchmarks/endpoint_flood.py
    python benchmarks/endpoint_flood.py --steps 20 --requests 2000

Every setting it does not measure is pinned here (task, batch, lengths, seed,
threads), so a change to a shipped config cannot move its figure. Prints the
median step time of each phase and, as its last line, a JSON object with
quiet_step_s, flood_step_s, requests, refused and rate_ratio (quiet / flood:
the share of its step rate the run keeps under the flood; goal >= 0.8).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO, GRPOConfig  # noqa: E402
from benchmarks.pins import UNMEASURED  # noqa: E402
from meshrl.config import load_config  # noqa: E402

PINNED = [
    "task.name=reverse_digits",
    "prompts_per_step=8",
    "group_size=4",
    "generation.max_new_tokens=12",
    *UNMEASURED,
    "warm_start.steps=0",
    "run.seed=0",
    "placement.policy=1",
    "placement.trainer=1",
    "placement.threads_per_proc=1",
]


_CHAT = {"model": "meshrl-policy", "messages": [{"role": "user", "content": "12>"}]}
_LONG = json.dumps({"model": "meshrl-policy", "prompt": "7" * (5 << 20)}).encode()


def abusive(i: int) -> tuple[str, str, bytes, dict]:
    """The i-th request of the flood: (method, path, body, headers)."""
    chat = _CHAT
    kind = i % 6
    if kind == 0:  # a 300 MB body, announced
        return "POST", "/v1/completions", b"{", {"Content-Length": str(300 << 20)}
    if kind == 1:  # a 5 MB prompt
        return "POST", "/v1/completions", _LONG, {}
    if kind == 2:
        return "POST", "/v1/chat/completions", b"{not json", {}
    if kind == 3:
        return "POST", "/v1/chat/completions", json.dumps({**chat, "model": "gpt"}).encode(), {}
    if kind == 4:
        body = json.dumps({**chat, "temperature": 1e-39}).encode()
        return "POST", "/v1/chat/completions", body, {}
    path = f"/episodes/{i % 3}.0.{i % 8}~guess/v1/chat/completions"
    return "POST", path, json.dumps(chat).encode(), {}


def flood(port: int, stop: threading.Event, counts: dict, lock: threading.Lock, offset: int):
    i = offset
    while not stop.is_set():
        method, path, body, headers = abusive(i)
        i += 16
        status = "error"
        try:
            if "Content-Length" in headers:  # the body never comes: say 300 MB, send 1 byte
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n"
                    head += f"Content-Length: {headers['Content-Length']}\r\n\r\n"
                    s.sendall(head.encode() + body)
                    status = s.recv(64).split(b" ")[1].decode()
            else:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request(method, path, body=body, headers=headers)
                status = str(conn.getresponse().status)
                conn.close()
        except (OSError, IndexError):
            pass
        with lock:
            counts[status] = counts.get(status, 0) + 1


def attacker(port: int, requests: int) -> None:
    """The flood, from a process of its own (as another local user's would be):
    100 idle connections, 16 threads until `requests` were sent; prints the
    answers' counts as JSON."""
    stop, lock, counts = threading.Event(), threading.Lock(), {}
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    clients = [
        threading.Thread(target=flood, args=(port, stop, counts, lock, k), daemon=True)
        for k in range(16)
    ]
    for client in clients:
        client.start()
    while sum(counts.values()) < requests:
        time.sleep(0.1)
    stop.set()
    for client in clients:
        client.join(timeout=30)
    for s in idle:
        s.close()
    print(json.dumps(counts), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps timed in each phase")
    parser.add_argument("--requests", type=int, default=500, help="at least this many")
    parser.add_argument("--attack", type=int, default=0, help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.attack:
        attacker(args.attack, args.requests)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            GRPOConfig,
            os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml"),
            [
                *PINNED,
                f"steps={4 * args.steps}",
                f"policy.serve_port={port}",
                f"run.dir={run_dir}",
                "run.name=flood",
                "run.progress=false",
            ],
        )
        algo = GRPO(cfg)
        try:
            algo.train(2)  # warm: the first steps pay for compilation and caches
            quiet = [r["time/step_s"] for r in algo.train(args.steps)[-args.steps :]]
            child = subprocess.Popen(
                [sys.executable, __file__, "--attack", str(port), "--requests", str(args.requests)],
                stdout=subprocess.PIPE,
                text=True,
            )
            flooded = []
            while len(flooded) < args.steps or child.poll() is None:
                flooded += [r["time/step_s"] for r in algo.train(1)[-1:]]
            counts = json.loads(child.communicate(timeout=60)[0].strip().splitlines()[-1])
        finally:
            algo.stop(save=False)
    q, f = statistics.median(quiet), statistics.median(flooded)
    sent = sum(counts.values())
    refused = sum(n for status, n in counts.items() if status in ("400", "404", "413"))
    print(f"{'phase':<10}{'steps':>7}{'median step s':>15}")
    print(f"{'quiet':<10}{len(quiet):>7}{q:>15.3f}")
    print(f"{'flood':<10}{len(flooded):>7}{f:>15.3f}   {sent} requests, answers {counts}")
    result = {
        "quiet_step_s": round(q, 4),
        "flood_step_s": round(f, 4),
        "requests": sent,
        "refused": refused,
        "rate_ratio": round(q / f, 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
