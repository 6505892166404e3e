# megazero: every target sets itself up; `make pretrain-gpt2` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A pinned torch (the CPU wheel where one is on local disk); override e.g. for a CUDA build.
TORCH_SPEC ?= torch==2.13.0
INSTALL_STAMP := $(VENV)/.megazero-installed
DATA_DIR ?= data
CORPUS_DIR := $(DATA_DIR)/shakespeare
DATA_PREFIX := $(DATA_DIR)/gpt2/shakespeare
DATA_STAMP := $(DATA_PREFIX)_train_text_document.idx
BERT_PREFIX := $(DATA_DIR)/bert/shakespeare
BERT_STAMP := $(BERT_PREFIX)_train_text_sentence.idx
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install data data-bert pretrain-gpt2 pretrain-llama pretrain-bert test test-fast test-torch-min lint bench docs check-cuda check-gpu gpu-wheels clean

install: $(INSTALL_STAMP)

$(INSTALL_STAMP): pyproject.toml requirements.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -e ".[dev,hf]"
	@touch $@

# `make bench` adds the peers it compares against (the `bench` extra: DeepSpeed and what it needs),
# with torch held at the installed pin so the resolver cannot swap it
BENCH_STAMP := $(VENV)/.megazero-bench-installed
$(BENCH_STAMP): pyproject.toml | $(INSTALL_STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[bench]" "$(TORCH_SPEC)"
	@touch $@

data: $(DATA_STAMP)

# the install is an order-only prerequisite: a reinstall does not make the data stale
$(DATA_STAMP): scripts/fetch_corpus.py scripts/preprocess_data.py | $(INSTALL_STAMP)
	$(BIN)/python scripts/fetch_corpus.py --out $(CORPUS_DIR)
	$(BIN)/python scripts/preprocess_data.py --input $(CORPUS_DIR) --output-prefix $(DATA_PREFIX) \
		--vocab-size 8000 --valid-fraction 0.05

pretrain-gpt2: install data
	bash scripts/pretrain_gpt2.sh $(ARGS)

# the Llama (configs/llama_cpu.json: GQA, RoPE, SwiGLU, untied; GPT-2 CPU's parameter count) on the same corpus
pretrain-llama: install data
	bash scripts/pretrain_llama.sh $(ARGS)

data-bert: $(BERT_STAMP)

# BERT: sentences grouped by document, a tokenizer with [CLS] [SEP] [MASK] [PAD] pieces
$(BERT_STAMP): scripts/fetch_corpus.py scripts/preprocess_data.py | $(INSTALL_STAMP)
	$(BIN)/python scripts/fetch_corpus.py --out $(CORPUS_DIR)
	$(BIN)/python scripts/preprocess_data.py --input $(CORPUS_DIR) --output-prefix $(BERT_PREFIX) \
		--vocab-size 8000 --valid-fraction 0.05 --split-sentences --special-tokens "[CLS]" "[SEP]" "[MASK]" "[PAD]"

pretrain-bert: install data-bert
	bash scripts/pretrain_bert.sh $(ARGS)

test: install lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check megazero models scripts tests benchmarks

# DeepSpeed on CPU: its CPU accelerator and gloo (its ops JIT-build on first use, 1-2 minutes, cached).
# Each benchmark writes benchmarks/results/<name>.json (committed: the latest run); docs/benchmarks.md
# is generated from them at the end (`make docs`).
bench: install data $(BENCH_STAMP)
	DS_ACCELERATOR=cpu $(BIN)/python -m benchmarks.bench_zero $(ARGS)
	$(BIN)/python -m benchmarks.bench_collectives
	$(BIN)/python -m benchmarks.bench_parallel
	$(BIN)/python -m benchmarks.bench_activations
	DS_ACCELERATOR=cpu $(BIN)/python -m benchmarks.bench_cpu_adam
	$(BIN)/python -m benchmarks.bench_watchdog
	$(BIN)/python -m benchmarks.bench_moe
	$(BIN)/python -m benchmarks.bench_moe_zero
	$(BIN)/python -m benchmarks.bench_onebit
	$(BIN)/python -m benchmarks.report

# docs/benchmarks.md from benchmarks/results/*.json (tests/unit/test_benchmark_report.py checks it is current)
docs: install
	$(BIN)/python -m benchmarks.report

# The oldest torch megazero supports (megazero/compat.py), which the lent GPU machines' image has
# (ci/gpu_image.txt): its own venv, a CUDA build from PyPI (it runs on a CPU too). `make test-torch-min`
# runs the fast suite under it; `make check-cuda` compiles the CUDA ops against it.
TORCH_MIN_SPEC ?= torch==2.11.0
MIN_VENV := .venv-torch-min
MIN_STAMP := $(MIN_VENV)/.megazero-installed
CUDA_ARCH ?= 9.0
# the toolkit directory (bin/nvcc, include, lib64); the first /usr/local/cuda-* by default
CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda-*) /usr/local/cuda)

# megazero's own dependencies (pyproject.toml, pinned by requirements.txt), pytest and ninja
$(MIN_STAMP): pyproject.toml requirements.txt
	@test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/pip install -q --disable-pip-version-check "$(TORCH_MIN_SPEC)"
	$(MIN_VENV)/bin/pip install -q --disable-pip-version-check -c requirements.txt -e ".[dev,hf]" ninja
	@touch $@

test-torch-min: $(MIN_STAMP) data
	$(MIN_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(MIN_VENV)/bin/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

check-cuda: $(MIN_STAMP)
	CUDA_HOME=$(CUDA_HOME) TORCH_CUDA_ARCH_LIST=$(CUDA_ARCH) MEGAZERO_OPS_STRICT=1 $(MIN_VENV)/bin/python -m megazero.ops build
	@if $(MIN_VENV)/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
		$(MIN_VENV)/bin/python -m pytest -q -m cuda tests/ops tests/unit/test_peak_flops.py && \
		$(MIN_VENV)/bin/python -m benchmarks.gpu_ops; \
	else echo "no GPU here: compiled only"; fi

# What a lent GPU machine lacks of megazero's dependencies (scripts/gpu_env.py: pyproject.toml's, less
# the image's packages), as wheels for its Python in .whl/ (ci/gpu_wheels.txt lists them). Carry .whl/
# there and run the one command `python3 scripts/check_gpu.py` (docs/testing.md): it installs them.
gpu-wheels: install
	$(BIN)/python scripts/gpu_env.py download --dest .whl

# The prepared GPU check (scripts/check_gpu.py): builds the ops, runs the `cuda` tests, engine steps on
# the GPU, benchmarks/gpu_ops.py and GPT-2 124M's MFU in a 300 s budget, then prints a pass/fail table.
GPU_PYTHON ?= python3
check-gpu:
	$(GPU_PYTHON) scripts/check_gpu.py $(ARGS)

# benchmarks/results/ is committed (docs/benchmarks.md is generated from it): clean leaves it
clean:
	rm -rf checkpoints runs wandb .pytest_cache
