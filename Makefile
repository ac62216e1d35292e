# `make demo` and `make test` create .venv on first use; nothing is downloaded at run time.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ASSETS := build/tiny
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export WANDB_MODE := disabled
# the tests on every core (pytest-xdist, a few at most: each worker holds a model stack in memory); a worker takes its
# share of the cores for torch's threads (tests/conftest.py)
PARALLEL := -n auto --maxprocesses 4 --dist worksteal

.PHONY: help demo demo-fa2-reference blog-case test test-launch test-fast test-latest test-axolotl bench-axolotl chromium lint doctor \
	bench clean

## this list: every target and the first line of what it does
help:
	@awk '/^## /{if (!doc) doc = substr($$0, 4); next} /^[a-z][a-z0-9-]*:/{split($$1, t, ":"); \
		if (doc) printf "  %-20s %s\n", t[1], doc; doc = ""; next} {doc = ""}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[foundry,dev,report]'
	touch $(STAMP)

LATEST := .venv-latest
$(LATEST)/.installed: pyproject.toml constraints-latest.txt
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q -c constraints-latest.txt -e '.[dev,hf,report]'
	touch $@

# axolotl 0.19.0 with every package it pins (constraints-axolotl.txt); torch first: the CPU wheel on this disk (a plain
# `torch` requirement resolves to a CUDA build of several GB)
AXOLOTL := .venv-axolotl
$(AXOLOTL)/.installed: pyproject.toml constraints-axolotl.txt
	test -x $(AXOLOTL)/bin/python || $(PYTHON) -m venv $(AXOLOTL)
	$(AXOLOTL)/bin/python -m pip install -q --upgrade pip
	$(AXOLOTL)/bin/python -m pip install -q -c constraints-axolotl.txt torch==2.13.0
	$(AXOLOTL)/bin/python -m pip install -q -c constraints-axolotl.txt axolotl==0.19.0 -e '.[dev]'
	touch $@

$(ASSETS)/.done: $(STAMP)
	$(BIN)/foundry-attn assets $(ASSETS)
	touch $@

## the main job: a tiny Llama on tiny packed data, CPU, offline, every callback (about 2 minutes)
## the attention choice and why, fill ratios, a falling loss;
## then a short second run through transformers' FA2 code path on the pure-PyTorch reference kernel (CPU),
## where the tracer shows zero _upad_input calls per step on our unpad-once path
## (both runs' events under runs/demo/), and ends on what foundry_attn recorded: the fleet summary and a report
demo: $(ASSETS)/.done
	rm -rf runs/demo
	$(BIN)/composer train.py yamls/tiny_cpu.yaml model.events_dir=./runs/demo/tiny-cpu
	@echo "=== second run: FA2 code path on the pure-PyTorch REFERENCE kernel (not flash-attn) ==="
	$(BIN)/composer train.py yamls/tiny_cpu.yaml model.attn_implementation=flash_attention_2 \
		model.fa2_reference_kernel=true max_duration=10ba eval_interval=10ba run_name=tiny-cpu-fa2-reference \
		model.events_dir=./runs/demo/tiny-cpu-fa2-reference
	@echo "=== what foundry_attn recorded (runs/demo) ==="
	$(BIN)/foundry-attn events runs/demo --summary
	$(BIN)/foundry-attn report runs/demo -o runs/demo/report

## the same run through transformers' FA2 code path on the pure-PyTorch *reference* kernel (not flash-attn)
demo-fa2-reference: $(ASSETS)/.done
	$(BIN)/composer train.py yamls/tiny_cpu.yaml model.attn_implementation=flash_attention_2 \
		model.fa2_reference_kernel=true run_name=tiny-cpu-fa2-reference

## the public unpad report reproduced on CPU: 6 rows x 2048 (real 220,217,295,183,130,350) through the stock HF FA2 path
## (_upad_input in every layer) and our unpad-once path (none; the same cu_seqlens reach the varlen kernel)
blog-case: $(STAMP)
	$(BIN)/python tests/integrations/test_blog_case.py

## the tests on the pinned stack (LLM-Foundry 0.22, Composer 0.32, torch 2.7, transformers 4.51) in .venv,
## all but those that launch whole runs of their own (make test-launch)
test: $(STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not launch"

## the tests that are whole runs of their own, on the pinned stack: torchrun ranks (DDP, FSDP2, composer -n 2), the
## entry points over real flash-attn / TransformerEngine releases (fetched from PyPI into build/real-installs once),
## and the benchmarks end to end
test-launch: $(STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) -m launch

## the developer loop: every test but the slow and gpu ones, in about 30 s
## (slow: subprocesses, torchrun, Trainer runs, benches)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu"

## the core's tests on today's stack (transformers 5.x, torch 2.13 CPU, TRL, no Composer) in .venv-latest
## (tests marked `foundry` skip there and say why)
test-latest: $(LATEST)/.installed
	$(LATEST)/bin/python -m pytest -q $(PARALLEL)

## the axolotl plugin on real axolotl 0.19 (torch 2.13 CPU, transformers 5.16, TRL 1.9) in .venv-axolotl (about 2 minutes);
## its sample-packed batches, sdpa and eager, sdpa_varlen on and off, against each document alone and beside stock
test-axolotl: $(AXOLOTL)/.installed
	$(AXOLOTL)/bin/python -m pytest -q tests/axolotl

## the plugin beside stock axolotl sample packing (same data and seed, sdpa and eager, 3 rounds, about 13 minutes on
## 2 cores): each document alone, real tokens per CPU-second, peak RSS; bench-results/axolotl-cpu.{json,md}
bench-axolotl: $(AXOLOTL)/.installed
	rm -rf build/axolotl-bench
	PYTHONPATH=. PATH=$(AXOLOTL)/bin:$$PATH DO_NOT_TRACK=1 AXOLOTL_DO_NOT_TRACK=1 \
		$(AXOLOTL)/bin/python -m tests.axolotl.bench build/axolotl-bench
	cp build/axolotl-bench/bench.json bench-results/axolotl-cpu.json
	cp build/axolotl-bench/bench.md bench-results/axolotl-cpu.md

## headless Chromium for the report test (apt-get; .ci/run calls it); never fails: without it, that test skips
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		{ command -v apt-get >/dev/null && timeout 600 sh -c 'apt-get install -y -q chromium >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }' ; } || \
		echo "chromium not installed: the report test will skip"

## ruff check, ruff format --check and mypy
## (ruff: pyflakes, pycodestyle, isort, pyupgrade, bugbear, RUF, docstring layout, on everything; mypy on the core)
## (foundry_attn/*.py and foundry_attn/bench; the files are listed under [tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## what attention can run on this machine, and why not
doctor: $(STAMP)
	$(BIN)/foundry-attn doctor

## every CPU benchmark, each printing ratios measured side by side (about 30 minutes; bench trainer on .venv-latest)
bench: $(STAMP) $(LATEST)/.installed
	$(BIN)/foundry-attn bench padding --json
	$(BIN)/foundry-attn bench callbacks --json
	$(BIN)/foundry-attn bench compile --json
	$(BIN)/foundry-attn bench proof --json
	$(BIN)/foundry-attn bench events --json
	$(BIN)/foundry-attn bench guard --json
	$(BIN)/foundry-attn bench train --json
	$(LATEST)/bin/foundry-attn bench trainer --json
	$(LATEST)/bin/foundry-attn bench rows --json
	$(LATEST)/bin/foundry-attn bench layouts --json
	$(LATEST)/bin/foundry-attn bench host --json --threads 1

## remove the tiny assets, the demo runs and pytest's cache
clean:
	rm -rf build runs .pytest_cache
