"""Runs the benchmarks of README's speed table, saves each one's JSON object with
the commit, the date and the machine in `benchmarks/data/speed/<row>.json`, and
rewrites the table between the `speed:start` / `speed:end` markers from every
saved file. Figures in the table come from there, never typed by hand.

    make speed                                          # every row (tens of minutes)
    python benchmarks/speed.py --only generation fanout # re-measure some rows, keep the others
    python benchmarks/speed.py --render                 # only rewrite the table from the files
    python benchmarks/speed.py --list                   # the rows and their commands
    python benchmarks/speed.py --smoke                  # each row at a tiny size: saves nothing

Each row runs its benchmark as a subprocess with every setting of the row given
on the command line (a changed default cannot move a figure), takes the JSON
object that the benchmark prints last, and renders the table's three cells from
it. A row that fails prints one error naming it and the others go on; the table
is still rewritten from what is saved. A row without a saved file is shown as
not measured yet.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.results import commit as results_commit  # noqa: E402
from benchmarks.results import machine  # noqa: E402

DATA = os.path.join(REPO, "benchmarks", "data", "speed")
README = os.path.join(REPO, "README.md")
START, END = "<!-- speed:start -->", "<!-- speed:end -->"
HEADER = "| benchmark | meshrl | the alternative, same run |"
RULE = "|---|---|---|"
RECORD_KEYS = ("row", "command", "commit", "date", "machine", "result")


class SpeedError(Exception):
    """A saved file, a page or a benchmark's output that the table cannot use."""


# --- figures as the table writes them -------------------------------------------------


def fixed(value: float, places: int) -> str:
    """`value` to `places` decimals, halves rounded up as a reader would (3.955 ->
    3.96; `format` rounds the binary float: 3.95)."""
    quantum = Decimal(1).scaleb(-places)
    return str(Decimal(repr(float(value))).quantize(quantum, rounding=ROUND_HALF_UP))


def times(value: float) -> str:
    return f"{fixed(value, 2)}×"


def ms(seconds: float, places: int = 1) -> str:
    return fixed(seconds * 1e3, places)


def percent(fraction: float, places: int = 1) -> str:
    return f"{fixed(fraction * 100, places)}%"


def millions(count: int) -> str:
    return f"{fixed(count / 1e6, 1)}M"


def two_digits(ratio: float) -> str:
    """Two significant digits for a ratio below 1 (0.049, 0.23)."""
    return f"{ratio:.2g}" if 0 < ratio < 1 else fixed(ratio, 2)


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs (as benchmarks/scale_model.py fits it)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0


# --- the rows: each turns its benchmark's JSON object into the table's three cells -----

Cells = tuple[str, str, str]


def weight_sync(record: dict, short: bool = False) -> Cells:
    (size, f), *rest = record["result"].items()  # one size per row: "100MB"
    if rest:
        raise KeyError("one size per row (--sizes N)")
    few = f["delta"]["few_changed"]
    changed = round(100 * few["delta_bytes"] / few["full_bytes"])  # the tensors are equal-sized
    delta = (
        f"{few['delta_bytes'] / 1e6:.1f} MB in {ms(few['delta_s'], 0)} ms against "
        f"{few['full_bytes'] / 1e6:.1f} MB in {ms(few['full_s'], 0)} ms"
    )
    # The second size's row says the same more briefly, as README always has.
    copied = "copied" if short else "copied out of shared memory (before zero-copy)"
    if short:
        delta = f"delta, {changed}% changed: {delta}"
    else:
        delta = f"delta over RDMA with {changed}% of tensors changed {delta}"
    # The floor of a checked sync (one copy with its sum, one verifying read), where
    # the record has it (since the compiled copy-and-sum).
    floor = (
        f", copy + verifying read {ms(f['floor_s'])} ms ({times(f['sync_over_floor'])})"
        if "floor_s" in f
        else ""
    )
    return (
        f"`weight_sync.py`, {size.removesuffix('MB')} MB, same host, served in place, checksummed",
        f"{ms(f['sync_s'])} ms",
        f"memcpy {ms(f['memcpy_s'])} ms ({times(f['sync_over_memcpy'])}){floor}, gloo broadcast "
        f"{ms(f['gloo_s'])} ms ({times(f['sync_over_gloo'])}), per-tensor RDMA reads "
        f"{ms(f['rdma_per_tensor_s'], 0)} ms; unchecked {ms(f['sync_unverified_s'])} ms "
        f"({times(f['sync_unverified_over_memcpy'])} memcpy); {copied} {ms(f['copy_sync_s'])} ms; "
        f"over RDMA {ms(f['sync_over_rdma_s'], 0)} ms; {delta}",
    )


def proc_start(record: dict) -> Cells:
    r = record["result"]
    ready, respawn = r["ready_s"], r["respawn_s"]
    return (
        f"`proc_start.py`, a `local` mesh of {r['procs']} procs importing the policy actor, "
        "until every proc answers",
        f"forked from the fork server {fixed(ready['forked'], 2)} s; a lost proc serving again "
        f"{fixed(respawn['forked'], 2)} s",
        f"fresh Pythons {fixed(ready['fresh'], 2)} s "
        f"({two_digits(ready['ratio_forked_over_fresh'])}×); respawn "
        f"{fixed(respawn['fresh'], 2)} s ({two_digits(respawn['ratio_forked_over_fresh'])}×)",
    )


def grpo_vs_trl(record: dict) -> Cells:
    r = record["result"]
    cells = list(r["step_time_ratio"])  # 4M_short, 4M_long, 34M_short, 34M_long
    models = list(dict.fromkeys(cell.split("_")[0] for cell in cells))
    new_tokens = " or ".join(f"{r['max_new_tokens'][f'{m}_short']} ({m})" for m in models)
    long_prompt = max(r["prompt_tokens"].values())
    step = r["meshrl_step_s"]
    meshrl = "; ".join(
        f"{m}: {fixed(step[f'{m}_short'], 2)}{' s/step' if i == 0 else ''} short, "
        f"{fixed(step[f'{m}_long'], 2)} long"
        for i, m in enumerate(models)
    )
    trl = record.get("versions", {}).get("trl")  # speed.py records it; the sweep does not
    trl = f"TRL {'.'.join(trl.split('.')[:2])}" if trl else "TRL"
    return (
        # 8 prompts x 8 and the aggregation are the row's own arguments (ROWS).
        f"`grpo_vs_trl.py --sweep`, 8 prompts × 8 completions of exactly {new_tokens} tokens, "
        f"float32, `seq-mean-token-mean`; short prompt or a {long_prompt}-token "
        "chat-templated one",
        meshrl,
        f"{trl} `GRPOTrainer` (no gradient checkpointing, `loss_type=grpo`): `step_time_ratio` "
        f"(TRL ÷ meshrl) {', '.join(fixed(r['step_time_ratio'][c], 2) for c in cells)}; the 34M "
        "short cell is compute-bound on both sides ([docs/speed.md](docs/speed.md))",
    )


def prefix_training(record: dict) -> Cells:
    r = record["result"]
    cells = sorted((k for k in r if re.fullmatch(r"c\d+", k)), key=lambda k: int(k[1:]))
    if cells:  # `--cells`: tree against padded at each completion length, time and peak
        return (
            f"`prefix_training.py --cells`, trainer step, {r['prompts']} "
            f"prompt{'s' if r['prompts'] != 1 else ''} of "
            f"{r['prompt_tokens']} tokens × {r['group']} completions of "
            f"{' / '.join(c[1:] for c in cells)}, {millions(r['params'])} Llama",
            "`trainer.layout: tree` "
            + " / ".join(
                f"{fixed(r[c]['tree_step_s'], 2)} s, {fixed(r[c]['tree_peak_mb'], 0)} MB"
                for c in cells
            ),
            "padded "
            + " / ".join(
                f"{fixed(r[c]['padded_step_s'], 2)} s, {fixed(r[c]['padded_peak_mb'], 0)} MB"
                for c in cells
            )
            + " (tree ÷ padded: "
            + " / ".join(fixed(r[c]["tree_step_s"] / r[c]["padded_step_s"], 2) for c in cells)
            + ")",
        )
    return (
        f"`prefix_training.py`, trainer step, {r['prompts']} prompts of {r['prompt_tokens']} "
        f"tokens × {r['group']} completions of {r['completion_tokens']}, "
        f"{millions(r['params'])} Llama",
        f"`trainer.layout: tree` {fixed(r['tree_step_s'], 2)} s",
        f"padded {fixed(r['padded_step_s'], 2)} s ({times(r['speedup_tree'])}), packed "
        f"{fixed(r['packed_step_s'], 2)} s",
    )


def generation(record: dict) -> Cells:
    r = record["result"]
    groups = [m.group(1) for m in map(re.compile(r"G(\d+)_speedup$").match, r) if m]
    if not groups:
        raise KeyError("G<n>_speedup")

    def per_group(key: str) -> str:
        return " / ".join(f"{r[f'G{g}_{key}_tokens_per_s']:,.0f}" for g in groups)

    return (
        f"`generation.py`, sampler, {r['prompts']} prompts of {r['prompt_tokens']} tokens, "
        f"G = {' / '.join(groups)}, {millions(r['params'])} Llama",
        f"shared prefill + dropped rows: {per_group('both')} tokens/s",
        f"plain {per_group('plain')} tokens/s "
        f"({' / '.join(times(r[f'G{g}_speedup']) for g in groups)}), "
        + ("same tokens" if r["tokens_equal"] else "other tokens"),
    )


def step_breakdown(record: dict) -> Cells:
    r = record["result"]
    runtime = sum(v for k, v in r.items() if k.endswith("_runtime_s"))
    return (
        "`step_breakdown.py`, default GRPO",
        f"controller overhead {percent(r['controller_overhead_fraction'])} of a "
        f"{ms(r['step_s'], 0)} ms step; the actor runtime's round trips {ms(runtime, 0)} ms "
        f"({percent(runtime / r['step_s'], 0)})",
        ", ".join(
            f"{name} {percent(r[f'{phase}_fraction'], 0)}"
            for name, phase in (
                ("generate", "generate"),
                ("reference", "reference"),
                ("train", "train"),
                ("sync", "weight_sync"),
            )
        ),
    )


def fanout(record: dict) -> Cells:
    r = record["result"]
    star, relay = r["star"][-1], r["relay"][-1]  # the largest N

    def copies(row: dict) -> str:
        return f"{row['trainer_egress_bytes'] / r['model_bytes']:.0f}"

    return (
        f"`fanout.py`, {r['model_bytes'] / 2**20:.0f} MB to {relay['replicas']} replicas on "
        "`process` hosts",
        f"relay tree: {fixed(relay['sync_s'], 2)} s, trainer egress {copies(relay)} copies",
        f"star {fixed(star['sync_s'], 2)} s (relay ÷ star: "
        f"{fixed(relay['sync_s'] / star['sync_s'], 2)}), egress {copies(star)} copies; both "
        f"bound by this machine's {fixed(star['trainer_egress_bytes'] / star['sync_s'] / 1e9, 2)}"
        " GB/s aggregate TCP-fallback rate",
    )


def controller_scale(record: dict) -> Cells:
    star = record["result"]["star"]
    per_replica = slope([r["replicas"] for r in star], [r["controller_cpu_s"] for r in star])
    return (
        "`controller_scale.py`, GRPO's loop over N stand-in replicas and environments",
        "controller share of the step: "
        + ", ".join(f"{percent(r['controller_share'])} at N = {r['replicas']}" for r in star[-2:]),
        f"{percent(star[0]['controller_share'])} at N = {star[0]['replicas']}; about "
        f"{ms(per_replica)} ms of controller CPU per replica a step",
    )


def long_tail(record: dict) -> Cells:
    r = record["result"]
    step, tokens, occupancy = r["step_s"], r["gen_tokens_per_s"], r["occupancy"]

    def variant(name: str) -> str:
        return (
            f"{fixed(step[name], 2)} s, {tokens[name]:.0f} tokens/s, "
            f"occupancy {percent(occupancy[name], 0)}"
        )

    reward = r["reward_last20"]
    return (
        "`long_tail.py`, GRPO, 16 prompts × 8 on 2 replicas, 10% of rows 65-1,024 tokens",
        f"partial rollouts: {variant('partial')}; step ÷ split {fixed(r['step_ratio'], 2)}, "
        f"tokens/s × {fixed(r['speedup_tokens'], 2)}",
        f"synchronous split {variant('split')}; pull {variant('pull')}; continuous "
        f"{variant('continuous')}; reward after {r['learn_steps']} steps "
        f"{fixed(reward['partial'], 3)} vs split's {fixed(reward['split'], 3)}",
    )


@dataclass(frozen=True)
class Row:
    """One line of the table: `script` with `args` (every setting, given) makes the
    JSON object that `render` turns into the three cells. `title` is the first cell
    while the row has not been measured. `smoke` are arguments appended for `--smoke`
    (argparse keeps the last value). `needs`: modules the benchmark imports that
    `.[bench]` installs."""

    name: str
    script: str
    args: tuple[str, ...]
    title: str
    render: Callable[[dict], Cells]
    smoke: tuple[str, ...] = ()
    timeout_s: int = 1800
    needs: tuple[str, ...] = ()

    def command(self, smoke: bool = False) -> list[str]:
        extra = self.smoke if smoke else ()
        return [os.path.join("benchmarks", self.script), *self.args, *extra]


def _weight_sync_short(record: dict) -> Cells:
    return weight_sync(record, short=True)


SMALL_MODEL = ("--hidden", "64", "--layers", "1")
ROWS = [
    *(
        Row(
            f"weight_sync_{mb}mb",
            "weight_sync.py",
            ("--sizes", str(mb), "--repeats", "5", "--few", "0.1"),
            f"`weight_sync.py`, {mb} MB, same host, served in place, checksummed",
            render,
            smoke=("--sizes", "10", "--repeats", "1"),
        )
        for mb, render in ((100, weight_sync), (500, _weight_sync_short))
    ),
    Row(
        "proc_start",
        "proc_start.py",
        ("--procs", "4", "--rounds", "3"),
        "`proc_start.py`, a `local` mesh of 4 procs importing the policy actor, "
        "until every proc answers",
        proc_start,
        smoke=("--procs", "1", "--rounds", "1"),
    ),
    Row(
        "grpo_vs_trl",
        "grpo_vs_trl.py",
        ("--sweep", "--steps", "6", "--prompts", "8", "--group", "8")
        + ("--aggregation", "seq-mean-token-mean"),
        "`grpo_vs_trl.py --sweep`, 8 prompts × 8 completions of exactly 16 (4M) or 32 (34M) "
        "tokens, float32, `seq-mean-token-mean`; short prompt or a 256-token chat-templated one",
        grpo_vs_trl,
        smoke=("--steps", "3", "--prompts", "1", "--group", "2"),
        timeout_s=3600,
        needs=("trl",),
    ),
    Row(
        "prefix_training",
        "prefix_training.py",
        ("--prompts", "4", "--group", "8", "--prompt", "512", "--completion", "64")
        + ("--hidden", "256", "--layers", "4", "--steps", "4"),
        "`prefix_training.py`, trainer step, 4 prompts of 512 tokens × 8 completions of 64",
        prefix_training,
        smoke=("--prompts", "1", "--group", "2", "--prompt", "16", "--completion", "8")
        + SMALL_MODEL
        + ("--steps", "2"),
    ),
    Row(
        "prefix_training_long",
        "prefix_training.py",
        ("--cells", "1024,4096", "--prompts", "1", "--group", "8", "--prompt", "512")
        + ("--hidden", "256", "--layers", "4", "--steps", "3"),
        "`prefix_training.py --cells`, trainer step, 1 prompt of 512 tokens × 8 completions "
        "of 1024 / 4096",
        prefix_training,
        smoke=("--cells", "16", "--prompt", "16", "--group", "2") + SMALL_MODEL + ("--steps", "2"),
    ),
    Row(
        "generation",
        "generation.py",
        ("--prompts", "8", "--groups", "8", "16", "--prompt", "128", "--max-new-tokens", "64")
        + ("--stops", "3", "--hidden", "256", "--layers", "4", "--repeats", "3"),
        "`generation.py`, sampler, 8 prompts of 128 tokens, G = 8 / 16",
        generation,
        smoke=("--prompts", "2", "--groups", "2", "4", "--prompt", "8", "--max-new-tokens", "4")
        + SMALL_MODEL
        + ("--repeats", "1"),
    ),
    Row(
        "step_breakdown",
        "step_breakdown.py",
        ("--steps", "100"),
        "`step_breakdown.py`, default GRPO",
        step_breakdown,
        smoke=("--steps", "3", "warm_start.steps=0"),
    ),
    Row(
        "fanout",
        "fanout.py",
        ("--replicas", "1", "2", "4", "8", "16", "--mb", "64", "--fanouts", "1", "2", "4")
        + ("--repeats", "5"),
        "`fanout.py`, 64 MB to 16 replicas on `process` hosts",
        fanout,
        smoke=("--replicas", "1", "2", "--mb", "8", "--fanouts", "2", "--repeats", "1"),
    ),
    Row(
        "long_tail",
        "long_tail.py",
        ("--steps", "12", "--skip", "3", "--learn-steps", "120", "--tolerance", "0.05"),
        "`long_tail.py`, GRPO, 16 prompts × 8 on 2 replicas, 10% of rows 65-1,024 tokens",
        long_tail,
        smoke=("--steps", "2", "--skip", "1", "--learn-steps", "2"),
    ),
    Row(
        "controller_scale",
        "controller_scale.py",
        ("--replicas", "1", "2", "4", "8", "16", "24", "--steps", "12"),
        "`controller_scale.py`, GRPO's loop over N stand-in replicas and environments",
        controller_scale,
        smoke=("--replicas", "1", "2", "--steps", "4"),
        timeout_s=3600,  # up to 49 procs started per N on 2 cores
    ),
]


# --- saved records --------------------------------------------------------------------


def commit() -> str:
    """The short commit, `+dirty` when tracked files differ from it."""
    return results_commit("+dirty")


def load(path: str) -> dict:
    """A saved record, checked: a file the table cannot use is one error naming it."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise SpeedError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(record, dict):
        raise SpeedError(f"{path}: a speed record is a JSON object")
    missing = [key for key in RECORD_KEYS if key not in record]
    if missing:
        raise SpeedError(f"{path}: a speed record needs {', '.join(missing)}")
    return record


def save(record: dict, data_dir: str) -> str:
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, f"{record['row']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(path + ".tmp", path)  # a run killed here leaves the old record whole
    return path


def measure(row: Row, smoke: bool = False) -> dict:
    """Runs the row's benchmark; its last stdout line, with where and when it ran."""
    missing = [m for m in row.needs if importlib.util.find_spec(m) is None]
    if missing:
        raise SpeedError(f"needs {', '.join(missing)}: pip install -e '.[bench]' (make speed)")
    command = row.command(smoke)
    timeout_s = 600 if smoke else row.timeout_s
    started = time.monotonic()
    # A session of its own: on a timeout (or Ctrl-C) the benchmark's procs go with it,
    # and none is left to take the cores from the next row.
    proc = subprocess.Popen(
        [sys.executable, *command],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException as e:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise SpeedError(f"timed out after {timeout_s} s") from None
        raise
    wall_s = time.monotonic() - started
    if proc.returncode:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise SpeedError(f"exit {proc.returncode}:\n{tail}")
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise SpeedError("its last stdout line is not a JSON object") from None
    if not isinstance(result, dict):
        raise SpeedError("its last stdout line is not a JSON object")
    record = {
        "row": row.name,
        "command": " ".join(["python", *command]),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "wall_s": round(wall_s, 1),
        "result": result,
    }
    versions = {m: _version(m) for m in row.needs}
    if versions:
        record["versions"] = versions
    return record


def _version(module: str) -> str:
    from importlib.metadata import version

    return version(module)


# --- the table ------------------------------------------------------------------------


def table_line(cells: Cells) -> str:
    return "| " + " | ".join(cells) + " |"


def render_table(data_dir: str, head: str, rows: list[Row] = ROWS) -> str:
    """The marked block: a line per row from its saved record (or "not measured
    yet at `head`"), then one line saying where and when the rows were measured."""
    lines, measured = [START, HEADER, RULE], {}
    for row in rows:
        path = os.path.join(data_dir, f"{row.name}.json")
        if not os.path.exists(path):
            lines.append(
                table_line(
                    (
                        row.title,
                        f"not measured yet at {head}",
                        f'`make speed ARGS="--only {row.name}"`',
                    )
                )
            )
            continue
        record = load(path)
        try:
            cells = row.render(record)
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:
            raise SpeedError(f"{path}: the {row.name} row cannot be rendered ({e!r})") from None
        lines.append(table_line(cells))
        measured[row.name] = record
    lines += ["", stamp(measured, [r.name for r in rows if r.name not in measured]), END]
    return "\n".join(lines)


def stamp(measured: dict[str, dict], unmeasured: list[str]) -> str:
    """Rows grouped by the commit, the day and the machine they were measured at."""
    groups: dict[tuple, list[str]] = {}
    for name, r in measured.items():
        key = (r["commit"], r["date"][:10], r["machine"], r.get("note", ""))
        groups.setdefault(key, []).append(name)
    machines = {key[2] for key in groups}
    parts = []
    for (sha, day, where, note), names in groups.items():
        part = f"{', '.join(names)} at commit {sha} on {day}"
        part += f" ({where})" if len(machines) > 1 else ""
        parts.append(part + (f" ({note})" if note else ""))
    text = "Generated by `make speed` (benchmarks/speed.py) from benchmarks/data/speed/: "
    text += "; ".join(parts) if parts else "no row measured yet"
    if len(machines) == 1:
        text += f"; on {machines.pop()}"
    text += "."
    if unmeasured:
        text += f" Not measured yet: {', '.join(unmeasured)}."
    return text


def rewrite(text: str, block: str, page: str = "README.md") -> str:
    """`text` with its marked block replaced by `block`; the rest untouched."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise SpeedError(f"{page}: needs one {START} ... {END} block")
    before, rest = text.split(START)
    after = rest.split(END, 1)[1]
    return before + block + after


def write_readme(data_dir: str, page: str = README) -> None:
    with open(page) as f:
        text = f.read()
    new = rewrite(text, render_table(data_dir, commit()), os.path.relpath(page, REPO))
    with open(page, "w") as f:
        f.write(new)
    print(f"wrote the speed table into {os.path.relpath(page, REPO)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [row.name for row in ROWS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="ROW", help="rows to run")
    parser.add_argument("--render", action="store_true", help="run nothing: rewrite the table")
    parser.add_argument("--list", action="store_true", help="print the rows and their commands")
    parser.add_argument(
        "--smoke", action="store_true", help="each row at a tiny size; saves and writes nothing"
    )
    parser.add_argument("--data", default=DATA, help=argparse.SUPPRESS)  # tests and trials
    args = parser.parse_args()
    if args.list:
        for row in ROWS:
            print(f"{row.name:<18} python {' '.join(row.command())}")
        return 0
    failed = []
    if not args.render:
        for row in ROWS:
            if args.only and row.name not in args.only:
                continue
            print(f"--- {row.name}: python {' '.join(row.command(args.smoke))}", flush=True)
            absent = [m for m in row.needs if importlib.util.find_spec(m) is None]
            if args.smoke and absent:  # a smoke run checks what this venv can run
                print(f"skipped {row.name}: {', '.join(absent)} not installed", flush=True)
                continue
            try:
                record = measure(row, args.smoke)
                cells = row.render(record)  # a result the row cannot render is a failure too
            except (SpeedError, KeyError, TypeError, ValueError) as e:
                print(f"error: row {row.name} failed: {e}", file=sys.stderr, flush=True)
                failed.append(row.name)
                continue
            print(table_line(cells), flush=True)
            if not args.smoke:
                print(f"saved {os.path.relpath(save(record, args.data), REPO)}", flush=True)
    if not args.smoke:
        try:
            write_readme(args.data)
        except SpeedError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if failed:
        print(f"error: failed rows: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
