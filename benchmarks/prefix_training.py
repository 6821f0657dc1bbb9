"""The trainer's step time with each prompt forwarded once per group (tree),
without padding (packed), and as the rectangular batch (padded), in one run.

    python benchmarks/prefix_training.py
    python benchmarks/prefix_training.py --prompt 256 --completion 32 --hidden 512 --layers 8
    python benchmarks/prefix_training.py --cells 1024,4096 --prompts 1 --hidden 128 --layers 2

Three real `Trainer` actors (one per `trainer.layout`) on one trainer proc,
each given the same GRPO batch: `--prompts` prompts of `--prompt` tokens, G =
`--group` completions of each, `--completion` tokens long, GRPO's loss with a
KL term. Each `train_step` (forward, backward, AdamW step) is timed at the
caller; the first is left out (warm-up) and the rest averaged. The three
trainers start from the same weights; their first steps' gradient norms are
printed as a check that they computed the same step. Prints a table, then one
JSON object: each layout's step seconds and `speedup_tree` (padded / tree),
`speedup_packed` (padded / packed).

`--cells` (completion lengths, e.g. 1024,4096) measures tree against padded at
each completion length instead, time and peak memory, without actors: each
(cell, layout) runs in a fresh process (multiprocessing's spawn) that does what
a trainer's `train_step` does, in process: `load_model` (the same seeded
weights in each), the layout's `completion_logprobs`, GRPO's loss with a KL
term, backward, gradient clipping and an AdamW step (`accumulated_step`, the
trainer's own). Peak memory: `torch.cuda.max_memory_allocated` on CUDA (reset
after the model and batch are on the device, so it counts the steps); on the
CPU the process's peak resident set (`ru_maxrss`; glibc returns freed blocks of
128 KB and more at once, `MALLOC_MMAP_THRESHOLD_`, so freed heap is not counted),
which also holds the
interpreter, torch and the weights, the same in both layouts (`<layout>_base_mb`:
the same measure before the first step). The JSON object then holds one object
per cell, `c<completion>`, with `padded_step_s`, `tree_step_s`,
`padded_peak_mb`, `tree_peak_mb`, `padded_base_mb`, `tree_base_mb`, `tree_over_padded_step`,
`tree_over_padded_peak`, `token_bound` ((P + G T) / (G (P + T)): the tree's
tokens over padded's) and both layouts' first gradient norms, and the settings.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import arguments, grpo_batch, grpo_loss  # noqa: E402
from meshrl.config import ModelConfig  # noqa: E402
from meshrl.types import TrainBatch  # noqa: E402

LAYOUTS = ("padded", "packed", "tree")
CELL_LAYOUTS = ("padded", "tree")
# `--dense`: the tree layout held to its dense L x L mask at every length (it takes the
# KV cache past `meshrl.model.tree.DENSE_TREE_TOKENS`), to measure what that saves.
DENSE = "tree_dense"


def actor_layouts(args) -> dict:
    """Every layout on a real `Trainer` actor: the step seconds and first grad norms."""
    from actors.trainer import Trainer
    from meshrl.config import OptimConfig
    from meshrl.model.models import load_model
    from meshrl.procs.mesh import RoleMeshes, wait

    model = ModelConfig.sized(args.hidden, args.layers, args.prompt + args.completion)
    batch = grpo_batch(args.prompts * args.group, args.group, args.prompt, args.completion)
    figures: dict = {}
    # One layout trains at a time: the proc may use every core.
    with RoleMeshes({"trainer": 1}, threads_per_proc=os.cpu_count()) as meshes:
        print(f"{'layout':<8}{'step s':>9}{'grad norm (step 1)':>20}")
        for layout in LAYOUTS:
            trainer = meshes.spawn(
                "trainer",
                layout,
                Trainer,
                model,
                OptimConfig(lr=1e-5),
                grpo_loss(),
                100,
                layout=layout,
            )
            times, norms = [], []
            for _ in range(args.steps):
                started = time.perf_counter()
                metrics = wait(trainer.train_step.call_one(batch), "train_step", 600)
                times.append(time.perf_counter() - started)
                norms.append(metrics["train/grad_norm"])
            figures[f"{layout}_step_s"] = round(sum(times[1:]) / len(times[1:]), 3)
            figures[f"{layout}_grad_norm"] = round(norms[0], 6)
            print(f"{layout:<8}{figures[f'{layout}_step_s']:>9.3f}{norms[0]:>20.6f}")
    figures["speedup_tree"] = round(figures["padded_step_s"] / figures["tree_step_s"], 2)
    figures["speedup_packed"] = round(figures["padded_step_s"] / figures["packed_step_s"], 2)
    figures.update(
        completion_tokens=args.completion,
        params=sum(p.numel() for p in load_model(model).parameters()),
    )
    return figures


def cell_steps(settings: dict) -> dict:
    """One (cell, layout) in this fresh process: `steps` trainer steps, the mean
    seconds of all but the first, the first gradient norm, the peak memory."""
    from meshrl.config import OptimConfig
    from meshrl.model.models import batch_logprobs, load_model
    from meshrl.procs.parallel import accumulated_step

    torch.set_num_threads(settings["threads"])
    if settings["layout"] == DENSE:
        import meshrl.model.tree

        meshrl.model.tree.DENSE_TREE_TOKENS = 1 << 62
        settings = {**settings, "layout": "tree"}
    cuda = torch.cuda.is_available()
    on = torch.device("cuda" if cuda else "cpu")
    prompt, completion = settings["prompt"], settings["completion"]
    cfg = ModelConfig.sized(settings["hidden"], settings["layers"], prompt + completion)
    model = load_model(cfg, seed=0).to(on).train()
    optim = OptimConfig(lr=1e-5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas))
    batch = grpo_batch(
        settings["prompts"] * settings["group"], settings["group"], prompt, completion
    )
    batch = batch.apply(lambda t: t.to(on))
    loss = grpo_loss()

    def loss_of(part: TrainBatch):
        return loss(batch_logprobs(model, part, 1.0, settings["layout"]), part)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mb = torch.cuda.memory_allocated() / 2**20
    else:
        base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times, norms = [], []
    for _ in range(settings["steps"]):
        started = time.perf_counter()
        _, _, norm, _ = accumulated_step([batch], loss_of, model, optimizer, optim.max_grad_norm)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        norms.append(norm)
    if cuda:
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:  # Linux reports kilobytes
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "step_s": sum(times[1:]) / len(times[1:]),
        "grad_norm": norms[0],
        "peak_mb": peak_mb,
        "base_mb": base_mb,
        "params": sum(p.numel() for p in model.parameters()),
    }


def cells(args) -> dict:
    """Tree against padded at each completion length of `args.cells`, each
    (cell, layout) in a fresh process."""
    spawn = multiprocessing.get_context("spawn")
    # On the CPU the peak is the resident set's high-water mark, which also counts
    # heap that glibc keeps after a free. Blocks of 128 KB and more are mapped and
    # unmapped instead, so the figure is the memory the layout held (at 4,096 the
    # tree's peak read 1.26x padded's without this, 0.96x with it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    figures: dict = {}
    print(f"{'cell':<8}{'layout':<8}{'step s':>9}{'peak MB':>10}{'grad norm (step 1)':>20}")
    for completion in args.cells:
        cell: dict = {}
        for layout in (*CELL_LAYOUTS, DENSE) if args.dense else CELL_LAYOUTS:
            settings = {**vars(args), "layout": layout, "completion": completion}
            with spawn.Pool(1) as pool:  # a fresh process: its peak is this layout's alone
                got = pool.apply(cell_steps, (settings,))
            cell[f"{layout}_step_s"] = round(got["step_s"], 3)
            cell[f"{layout}_peak_mb"] = round(got["peak_mb"], 1)
            cell[f"{layout}_base_mb"] = round(got["base_mb"], 1)
            cell[f"{layout}_grad_norm"] = round(got["grad_norm"], 6)
            figures["params"] = got["params"]
            print(
                f"c{completion:<7}{layout:<8}{got['step_s']:>9.3f}{got['peak_mb']:>10.1f}"
                f"{got['grad_norm']:>20.6f}"
            )
        P, G, T = args.prompt, args.group, completion
        cell["tree_over_padded_step"] = round(cell["tree_step_s"] / cell["padded_step_s"], 3)
        cell["tree_over_padded_peak"] = round(cell["tree_peak_mb"] / cell["padded_peak_mb"], 3)
        if args.dense:
            dense = cell[f"{DENSE}_step_s"] / cell["padded_step_s"]
            cell["tree_dense_over_padded_step"] = round(dense, 3)
        cell["token_bound"] = round((P + G * T) / (G * (P + T)), 3)
        figures[f"c{completion}"] = cell
    figures.update(
        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        hidden=args.hidden,
        layers=args.layers,
        threads=args.threads,
        peak="cuda max_memory_allocated"
        if torch.cuda.is_available()
        else f"cpu ru_maxrss, MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}",
    )
    return figures


def main() -> int:
    parser = arguments(
        __doc__, prompts=4, group=8, prompt=512, completion=64, hidden=256, layers=4, steps=4
    )
    parser.add_argument(
        "--cells",
        type=lambda s: [int(c) for c in s.split(",")],
        default=None,
        help="completion lengths, comma-separated: tree against padded at each, in process",
    )
    parser.add_argument(
        "--dense", action="store_true", help="--cells: the dense-mask tree at every length too"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch's threads (--cells)"
    )
    args = parser.parse_args()
    figures = cells(args) if args.cells else actor_layouts(args)
    figures.update(
        prompts=args.prompts,
        group=args.group,
        prompt_tokens=args.prompt,
        timed_steps=args.steps - 1,
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
