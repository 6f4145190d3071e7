"""Evaluation: how good a model is, and what quantizing or fine-tuning it cost.

    scoring.py      log p(continuation | context) for many pairs, each distinct context computed once
    perplexity.py   perplexity and bits per byte in sliding windows; KL divergence from a reference model
    harness.py      an lm-evaluation-harness model class backed by llmkit (imports lm_eval: the `eval` extra)
    tasks.py        llmkit's offline multiple-choice tasks, written as lm-evaluation-harness task files

`llmkit eval` (cli/evaluation.py) puts them on the command line; docs/evaluation.md has the figures.
"""

from llmkit.evaluate.perplexity import Divergence, Perplexity, divergence, perplexity
from llmkit.evaluate.scoring import Scored, score

__all__ = ["Divergence", "Perplexity", "Scored", "divergence", "perplexity", "score"]
