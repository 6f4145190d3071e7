"""The `llmkit` command line. Each subcommand is a typed function: its signature becomes the flags and its docstring
the help (see app.py); the functions live by concern in models.py, data.py, training.py, translation.py and
generation.py.

    llmkit presets                          list the named presets
    llmkit inspect PRESET_OR_CONFIG [--json] [--seq-len N] [--dtype fp32|bf16|fp16]
    llmkit inspect --compare llama2-7b,mixtral-8x7b,deepseek-v3
    llmkit generate RUN_OR_CHECKPOINT --prompt TEXT [--temperature T] [--beams N | --draft MODEL | --mtp]
    llmkit quantize CHECKPOINT OUT --to int8|int4|q4_k_m|q8_0|... [--group-size N] [--include-head] [--imatrix TEXT]
    llmkit convert CHECKPOINT OUT.gguf --to gguf [--quant q4_k_m|q8_0|...]   a file llama.cpp loads
    llmkit imatrix CHECKPOINT TEXT OUT.gguf   an importance matrix (for quantize / convert --imatrix FILE)
    llmkit prepare chat FILE.jsonl --tokenizer CHECKPOINT   conversations for chat fine-tuning
    llmkit prepare preferences FILE.jsonl --checkpoint CHECKPOINT   pairs of answers for DPO / IPO / SimPO
    llmkit merge RUN OUT                    fold a LoRA run's adapters into its base checkpoint
    llmkit graft-mtp CHECKPOINT OUT --data DIR   a drafting MTP module taught on the model's own text
    llmkit distill-draft CHECKPOINT OUT --data DIR   a draft model made of a few of its blocks, distilled likewise
    llmkit eval CHECKPOINT --tasks NAMES | --perplexity TEXT [--reference MODEL]   accuracy, perplexity, KL
    llmkit serve CHECKPOINT [--port 8000] [--api-key KEY] [--kv-memory 2GiB]   an OpenAI-compatible server
"""

from __future__ import annotations

from collections.abc import Sequence

from llmkit.cli.app import Command, run
from llmkit.cli.data import prepare
from llmkit.cli.evaluation import eval_
from llmkit.cli.generation import chat, generate
from llmkit.cli.models import compare, convert, imatrix, inspect, presets, quantize
from llmkit.cli.serving import serve
from llmkit.cli.training import average, distill_draft, graft_mtp, merge, train
from llmkit.cli.translation import translate

COMMANDS: tuple[Command, ...] = (
    presets,
    inspect,
    convert,
    quantize,
    imatrix,
    compare,
    prepare,
    train,
    translate,
    average,
    merge,
    graft_mtp,
    distill_draft,
    generate,
    chat,
    eval_,
    serve,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (argv: the arguments, default sys.argv[1:]); returns the exit status."""
    return run(COMMANDS, argv)
