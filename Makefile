# `make run`  : create .venv, install, run GRPO on the embedded default (ARGS="key=value ...")
# `make test` : create/update .venv, install, lint, run every test (WORKERS=2 pytest workers)
# `make check`: the fast tiers for the edit loop (lint, then tests/unit and tests/actors)
# `make bench` : the speed benchmarks (weight sync, the sampler's shared prompts, prefix-shared
#                training, GRPO vs TRL in four cells, step breakdown, rollout latency, sandbox,
#                relay fan-out, controller at scale, the scale model, stragglers by pull and
#                elastic pools, what images cost a step, the endpoint under a flood; minutes)
# `make soak`  : the fault soak benchmark (minutes; not part of `make test`)
# `make gpu-check`: every GPU path once, one JSON line of pass/fail and figures (docs/gpu.md;
#                 on a host without CUDA the checks run on the CPU)
# `make cluster`: start a private SLURM cluster on this machine (root; installs Debian's
#                 slurmctld/slurmd/slurm-client if missing) and print how to use it;
#                 `make cluster-stop` stops it
# `make results`: run every shipped config, rewrite the results tables in README and docs (~10 min)
# `make speed` : the benchmarks of README's speed table, each one's JSON object saved in
#                benchmarks/data/speed/, the table rewritten from every saved one (tens of
#                minutes; ARGS="--only ROW ..." re-measures some rows, ARGS=--render none)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKERS ?= 2
# Python keeps the bytecode it compiles (some machines set PYTHONDONTWRITEBYTECODE, and then
# every process compiled torch's modules anew); pip compiles nothing at install
# (`--no-compile`): the first import compiles only the modules a run uses, and keeps them.
unexport PYTHONDONTWRITEBYTECODE
ARGS ?=
CONFIG ?= algorithms/configs/grpo_default.yaml
ALGO ?= grpo

.PHONY: run test check lint bench soak gpu-check results speed clean cluster cluster-stop

# Makefile too: a .venv made before uv came into this recipe has no uv and no torch-pin.txt,
# which `make bench` and `make speed` use.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, alone and exact, by pip: it reads this machine's pip configuration and takes
	# the CPU build instead of a multi-GB CUDA one. uv comes with it.
	$(BIN)/pip install -q --no-compile --disable-pip-version-check torch==2.13.0 uv==0.13.9
	# The rest by uv, held to the torch just installed (measured here: 15 s, where pip took
	# 105 s for the same 230 packages, at the same versions).
	$(BIN)/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
		> $(VENV)/torch-pin.txt
	$(BIN)/uv pip install -q --python $(BIN)/python -c $(VENV)/torch-pin.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m algorithms.$(ALGO) --config $(CONFIG) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -n $(WORKERS) $(PYTEST_ARGS)

check: lint
	$(BIN)/python -m pytest -n $(WORKERS) tests/unit tests/actors $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/uv pip install -q --python $(BIN)/python -c $(VENV)/torch-pin.txt -e '.[bench]'
	$(BIN)/python benchmarks/weight_sync.py
	$(BIN)/python benchmarks/proc_start.py
	$(BIN)/python benchmarks/generation.py
	$(BIN)/python benchmarks/prefix_training.py
	$(BIN)/python benchmarks/step_breakdown.py
	$(BIN)/python benchmarks/grpo_vs_trl.py --sweep
	$(BIN)/python benchmarks/rollout_latency.py
	$(BIN)/python benchmarks/sandbox.py
	$(BIN)/python benchmarks/stragglers.py
	$(BIN)/python benchmarks/elastic.py
	$(BIN)/python benchmarks/vision.py
	$(BIN)/python benchmarks/endpoint_flood.py
	$(BIN)/python benchmarks/fanout.py --save runs/bench/fanout.json
	$(BIN)/python benchmarks/controller_scale.py --save runs/bench/controller_scale.json
	$(BIN)/python benchmarks/scale_model.py --fanout-json runs/bench/fanout.json \
		--controller-json runs/bench/controller_scale.json

cluster: $(STAMP)
	$(BIN)/python -m tests.support.slurm_cluster start --dir runs/slurm

cluster-stop: $(STAMP)
	$(BIN)/python -m tests.support.slurm_cluster stop --dir runs/slurm

gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py $(ARGS)

results: $(STAMP)
	$(BIN)/python benchmarks/results.py $(ARGS)

speed: $(STAMP)
	$(BIN)/uv pip install -q --python $(BIN)/python -c $(VENV)/torch-pin.txt -e '.[bench]'
	$(BIN)/python benchmarks/speed.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
