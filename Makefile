# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-ddp test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv==0.13.9
	# The local CPU build of torch first, with pip (its configuration names where that build is),
	# so nothing later pulls a CUDA build (the dev extra's transformers, for tests/models, needs no
	# torch of its own). The rest with uv: the same packages from the same index, resolved and
	# installed in parallel (24 s instead of pip's 63 s here); torch is named again so that the
	# build above is kept.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode -e '.[dev]' torch==2.13.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m remat.demo

# Two CPU ranks (gloo) train the demo GPT with ZeRO-2 under a per-rank budget.
demo-ddp: $(STAMP)
	$(BIN)/torchrun --nproc_per_node 2 -m remat.demo_ddp

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 tests

bench: $(STAMP)
	$(BIN)/python bench/chain_solver.py
	$(BIN)/python bench/graph_solvers.py
	$(BIN)/python bench/train_bench.py --no-compile
	$(BIN)/python bench/speed.py --no-compile

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
