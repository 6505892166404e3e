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

.PHONY: install data data-bert pretrain-gpt2 pretrain-llama pretrain-bert test test-fast lint bench docs check-cuda check-gpu gpu-wheels clean

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
	DS_ACCELERATOR=cpu $(BIN)/python benchmarks/bench_zero.py $(ARGS)
	$(BIN)/python benchmarks/bench_collectives.py
	$(BIN)/python benchmarks/bench_parallel.py
	$(BIN)/python benchmarks/bench_activations.py
	DS_ACCELERATOR=cpu $(BIN)/python benchmarks/bench_cpu_adam.py
	$(BIN)/python benchmarks/bench_watchdog.py
	$(BIN)/python benchmarks/bench_moe.py
	$(BIN)/python benchmarks/bench_onebit.py
	$(BIN)/python -m benchmarks.report

# docs/benchmarks.md from benchmarks/results/*.json (tests/unit/test_benchmark_report.py checks it is current)
docs: install
	$(BIN)/python -m benchmarks.report

# Compile the CUDA ops against a CUDA build of torch in a separate venv (not part of `make test`);
# on a machine with a GPU it then runs their tests and benchmarks/gpu_ops.py.
CUDA_TORCH_SPEC ?= torch==2.14.1
CUDA_ARCH ?= 9.0
# the toolkit directory (bin/nvcc, include, lib64); the first /usr/local/cuda-* by default
CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda-*) /usr/local/cuda)
# a directory or page of wheels to search besides pip's configured indexes (none by default)
CUDA_FIND_LINKS ?=
check-cuda:
	@test -x .venv-cuda/bin/python || $(PYTHON) -m venv .venv-cuda
	@.venv-cuda/bin/python -c "import torch; assert torch.version.cuda" 2>/dev/null || \
		.venv-cuda/bin/pip install -q --disable-pip-version-check $(if $(CUDA_FIND_LINKS),--find-links "$(CUDA_FIND_LINKS)") "$(CUDA_TORCH_SPEC)"
	.venv-cuda/bin/pip install -q --disable-pip-version-check numpy ninja pytest sentencepiece safetensors
	CUDA_HOME=$(CUDA_HOME) TORCH_CUDA_ARCH_LIST=$(CUDA_ARCH) MEGAZERO_OPS_STRICT=1 .venv-cuda/bin/python -m megazero.ops build
	@if .venv-cuda/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
		.venv-cuda/bin/python -m pytest -q -m cuda tests/ops tests/unit/test_peak_flops.py && .venv-cuda/bin/python benchmarks/gpu_ops.py; \
	else echo "no GPU here: compiled only"; fi

# The prepared GPU check (scripts/check_gpu.py): builds the ops, runs the `cuda` tests, engine steps
# on the GPU (fused kernels on/off; ZeRO 0-3 over NCCL against gloo), benchmarks/gpu_ops.py and
# GPT-2 124M's tokens/s and MFU, in at most 8 minutes on one GPU, then prints a pass/fail table.
# It installs nothing (a GPU machine often reaches no package index): GPU_PYTHON is a python with
# a CUDA torch, by default .venv-cuda's (made by check-cuda) where there is one, else python3.
GPU_PYTHON ?= $(if $(wildcard .venv-cuda/bin/python),.venv-cuda/bin/python,python3)
# The packages megazero needs that a lent GPU machine's image lacks (pydantic and what it needs), as
# wheels for its Python (3.12) in .whl/; `make gpu-wheels` here, where pip reaches an index, then
# carry .whl/ to the GPU machine: check-gpu installs them there when pydantic is missing.
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
GPU_WHEEL_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_WHEEL_PLATFORMS) -d .whl $(GPU_WHEELS)

check-gpu:
	@if ! $(GPU_PYTHON) -c "import pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
			--target /tmp/megazero-site .whl/*.whl; fi
	PYTHONPATH=/tmp/megazero-site:$$PYTHONPATH PYTHONUNBUFFERED=1 $(GPU_PYTHON) scripts/check_gpu.py $(ARGS)

# benchmarks/results/ is committed (docs/benchmarks.md is generated from it): clean leaves it
clean:
	rm -rf checkpoints runs wandb .pytest_cache
