# Everything a fresh machine needs: `make demo` and `make test` create the virtualenv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch 2.13 (on a CUDA machine pip picks the CUDA build of the same version).
TORCH_SPEC ?= torch==2.13.0
# litgpt's own pretraining loop runs in examples/litgpt_pretrain.py and its test; its pins would move torch and
# lightning, so it is installed without its dependencies (the ones it imports come with the test extra)
LITGPT_SPEC ?= litgpt==0.5.13
# transformers (for the tests that train Hugging Face models) goes to a folder outside site-packages, which only the
# test process adds to its path (tests/conftest.py): torchmetrics, which every `import lightning` imports, imports
# transformers whenever it is installed, one to several seconds in each of the processes the tests start. Its own
# dependencies come with the test extra (pyproject.toml), so it is installed without them.
TRANSFORMERS_SPEC ?= transformers==4.57.6
HUGGING_FACE := $(VENV)/hugging-face
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: install install-litgpt demo test lint bench bench-cluster bench-async bench-buffers bench-guard bench-fault clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps "$(LITGPT_SPEC)"
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(HUGGING_FACE) "$(TRANSFORMERS_SPEC)"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

install-litgpt: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps "$(LITGPT_SPEC)"

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25

lint: $(STAMP)
	$(BIN)/ruff check lightning_smp tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(ARGS)

# two nodes in network namespaces joined by a throttled link (needs root or CAP_NET_ADMIN); see docs/cluster.md
bench-cluster: $(STAMP)
	$(BIN)/python -m benchmarks.cluster $(ARGS)

# DiLoCo (replica_sync) against synchronous hybrid sharding across a 100 Mbit/s link, on the stdlib's sources (needs
# root or CAP_NET_ADMIN); see docs/replica-sync.md
bench-semi-sync: $(STAMP)
	$(BIN)/python -m benchmarks.semi_sync $(ARGS)

# how long a sharded save blocks training, blocking against async_save=True (4 CPU ranks); see docs/checkpoints.md
bench-async: $(STAMP)
	$(BIN)/python -m benchmarks.async_checkpoint $(ARGS)

# what broadcast_buffers=True (DDP's rule for BatchNorm statistics) costs a step (4 CPU ranks); see docs/engines.md
bench-buffers: $(STAMP)
	$(BIN)/python -m benchmarks.buffer_sync $(ARGS)

# the step guard's reduction, one all-reduce per mesh axis against one over the world (4 CPU ranks); see docs/performance.md
bench-guard: $(STAMP)
	$(BIN)/python -m benchmarks.guard_sync $(ARGS)

# a node killed mid-run and started again, with fault_tolerance= and without (2 nodes of the cluster harness; needs root
# or CAP_NET_ADMIN); see docs/fault-tolerance.md
bench-fault: $(STAMP)
	$(BIN)/python -m benchmarks.fault_tolerance $(ARGS)

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
