"""Does a flood of abusive requests to the policy endpoint slow the run that
serves it? GRPO trains with `policy.serve_port` open; the same run's steps are
timed without a flood, then while another process (16 client threads) sends at
least 500 requests the endpoint must refuse and 100 connections sit idle.

The flooder is the run's own user: it reads the run's token from status.json
(`endpoint_token`; 0600, its owner's) and sends it where a request is meant to
pass the token check and be refused later: 300 MB bodies (413), 5 MB prompts,
malformed JSON, unknown models and subnormal temperatures (400). Guessed
episode URLs (404) need no token. Calls without the token or with a wrong one
(401) and calls whose Host names another server (421) are kinds of their own.

    python benchmarks/endpoint_flood.py
    python benchmarks/endpoint_flood.py --steps 20 --requests 2000

Every setting it does not measure is pinned here (task, batch, lengths, seed,
threads), so a change to a shipped config cannot move its figure. Prints the
median step time of each phase, the answers by kind and by status and, as its
last line, a JSON object with quiet_step_s, flood_step_s, requests, refused
(answers with the status their kind expects), by_status, unexpected (answers
any other way: their kind and status) and rate_ratio (quiet / flood: the share
of its step rate the run keeps under the flood; goal >= 0.8).
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

from algorithms.grpo import GRPO  # noqa: E402
from benchmarks.pins import grpo_config  # noqa: E402
from meshrl.observe.status import STATUS_FILE  # noqa: E402

PINNED = [  # after `UNMEASURED` (`grpo_config`)
    "task.name=reverse_digits",
    "prompts_per_step=8",
    "group_size=4",
    "generation.max_new_tokens=12",
    "warm_start.steps=0",
    "run.seed=0",
    "placement.policy=1",
    "placement.trainer=1",
    "placement.threads_per_proc=1",
]


_CHAT = {"model": "meshrl-policy", "messages": [{"role": "user", "content": "12>"}]}
_LONG = json.dumps({"model": "meshrl-policy", "prompt": "7" * (5 << 20)}).encode()

KINDS = {  # the flood's kinds of request, in turn, and the status each must get
    "body_300mb": "413",
    "prompt_5mb": "400",
    "malformed": "400",
    "unknown_model": "400",
    "subnormal_temperature": "400",
    "guessed_episode": "404",
    "no_token": "401",
    "wrong_token": "401",
    "wrong_host": "421",
}


def abusive(i: int, token: str) -> tuple[str, str, str, bytes, dict]:
    """The i-th request of the flood: (kind, method, path, body, headers). Where
    it is meant to pass the token check, it carries `token`."""
    kind = list(KINDS)[i % len(KINDS)]
    chat = json.dumps(_CHAT).encode()
    auth = {"Authorization": f"Bearer {token}"}
    if kind == "body_300mb":  # announced; the body never comes
        return kind, "POST", "/v1/completions", b"{", {**auth, "Content-Length": str(300 << 20)}
    if kind == "prompt_5mb":
        return kind, "POST", "/v1/completions", _LONG, auth
    if kind == "malformed":
        return kind, "POST", "/v1/chat/completions", b"{not json", auth
    if kind == "unknown_model":
        body = json.dumps({**_CHAT, "model": "gpt"}).encode()
        return kind, "POST", "/v1/chat/completions", body, auth
    if kind == "subnormal_temperature":
        body = json.dumps({**_CHAT, "temperature": 1e-39}).encode()
        return kind, "POST", "/v1/chat/completions", body, auth
    if kind == "guessed_episode":  # an episode's URL is its own credential: no token
        path = f"/episodes/{i % 3}.0.{i % 8}~guess/v1/chat/completions"
        return kind, "POST", path, chat, {}
    if kind == "no_token":
        return kind, "POST", "/v1/chat/completions", chat, {}
    if kind == "wrong_token":
        return kind, "POST", "/v1/chat/completions", chat, {"Authorization": "Bearer guess"}
    # wrong_host: the token, but a name that is not the server's (DNS rebinding)
    return kind, "POST", "/v1/chat/completions", chat, {**auth, "Host": "rebound.example"}


def flood(
    port: int,
    token: str,
    stop: threading.Event,
    counts: dict,
    lock: threading.Lock,
    offset: int,
):
    i = offset
    while not stop.is_set():
        kind, method, path, body, headers = abusive(i, token)
        i += 16
        status = "error"
        try:
            if "Content-Length" in headers:  # the body never comes: say 300 MB, send 1 byte
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
                    s.sendall(head.encode() + b"\r\n" + body)
                    status = s.recv(64).split(b" ")[1].decode()
            else:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request(method, path, body=body, headers=headers)
                status = str(conn.getresponse().status)
                conn.close()
        except (OSError, IndexError):
            pass
        with lock:
            counts[f"{kind} {status}"] = counts.get(f"{kind} {status}", 0) + 1


def run_token(status_path: str, timeout_s: float = 120.0) -> str:
    """The run's endpoint token, read from its status.json as the run's own user
    would (the run writes it there at its next status write)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(status_path) as f:
                token = json.load(f).get("endpoint_token")
            if token:
                return token
        except (OSError, ValueError):  # not written yet, or mid-replace
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{status_path} has no endpoint_token after {timeout_s:.0f} s")
        time.sleep(0.2)


def attacker(port: int, status_path: str, requests: int) -> None:
    """The flood, from a process of its own (as another client's would be): 100
    idle connections, 16 threads until `requests` were sent; prints the answers'
    counts ("kind status": n) as JSON."""
    token = run_token(status_path)
    stop, lock, counts = threading.Event(), threading.Lock(), {}
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    clients = [
        threading.Thread(target=flood, args=(port, token, stop, counts, lock, k), daemon=True)
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
    parser.add_argument("--status", default="", help=argparse.SUPPRESS)  # its status.json
    args = parser.parse_args()
    if args.attack:
        attacker(args.attack, args.status, args.requests)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = grpo_config(
            *PINNED,
            f"steps={4 * args.steps}",
            f"policy.serve_port={port}",
            f"run.dir={run_dir}",
            "run.name=flood",
            "run.progress=false",
        )
        algo = GRPO(cfg)
        try:
            algo.train(2)  # warm: the first steps pay for compilation and caches
            quiet = [r["time/step_s"] for r in algo.train(args.steps)[-args.steps :]]
            status_path = os.path.join(run_dir, "flood", STATUS_FILE)
            child = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    *("--attack", str(port), "--status", status_path),
                    *("--requests", str(args.requests)),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            flooded = []
            while len(flooded) < args.steps or child.poll() is None:
                flooded += [r["time/step_s"] for r in algo.train(1)[-1:]]
            out = child.communicate(timeout=60)[0].strip()
            if child.returncode != 0 or not out:
                raise SystemExit(f"the flooder failed (exit code {child.returncode})")
            counts = json.loads(out.splitlines()[-1])
            unauthorized = algo.collector.server.unauthorized  # the server's own count
        finally:
            algo.stop(save=False)
    q, f = statistics.median(quiet), statistics.median(flooded)
    sent = sum(counts.values())
    by_kind: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}
    by_status: dict[str, int] = {}
    for key, n in counts.items():
        kind, status = key.split(" ")
        by_kind[kind][status] = by_kind[kind].get(status, 0) + n
        by_status[status] = by_status.get(status, 0) + n
    refused = sum(
        n for kind, answers in by_kind.items() for s, n in answers.items() if s == KINDS[kind]
    )
    unexpected = {
        key: n for key, n in counts.items() if key.split(" ")[1] != KINDS[key.split(" ")[0]]
    }
    print(f"{'phase':<10}{'steps':>7}{'median step s':>15}")
    print(f"{'quiet':<10}{len(quiet):>7}{q:>15.3f}")
    print(f"{'flood':<10}{len(flooded):>7}{f:>15.3f}   {sent} requests")
    print(f"{'kind':<24}{'expects':>8}  answers")
    for kind, answers in by_kind.items():
        print(f"{kind:<24}{KINDS[kind]:>8}  {json.dumps(dict(sorted(answers.items())))}")
    print(f"by status: {json.dumps(dict(sorted(by_status.items())))}")
    print(f"the server counted {unauthorized} calls without the token")
    result = {
        "quiet_step_s": round(q, 4),
        "flood_step_s": round(f, 4),
        "requests": sent,
        "refused": refused,
        "by_status": dict(sorted(by_status.items())),
        "unexpected": unexpected,
        "rate_ratio": round(q / f, 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
