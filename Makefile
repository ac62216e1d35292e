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

.PHONY: demo demo-fa2-reference test lint doctor bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

$(ASSETS)/.done: $(STAMP)
	$(BIN)/foundry-attn assets $(ASSETS)
	touch $@

## tiny Llama, tiny packed data, CPU, two callbacks; prints the attention choice, fill ratio, unpad calls
demo: $(ASSETS)/.done
	cd $(CURDIR) && $(BIN)/composer train.py yamls/tiny_cpu.yaml

## the same run through transformers' FA2 code path on the pure-PyTorch *reference* kernel (not flash-attn)
demo-fa2-reference: $(ASSETS)/.done
	$(BIN)/composer train.py yamls/tiny_cpu.yaml model.attn_implementation=flash_attention_2 \
		model.fa2_reference_kernel=true

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

doctor: $(STAMP)
	$(BIN)/foundry-attn doctor

bench: $(STAMP)
	$(BIN)/foundry-attn bench padding --json
	$(BIN)/foundry-attn bench callbacks --json

clean:
	rm -rf build runs .pytest_cache
