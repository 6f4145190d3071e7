"""Models split across processes: tensor parallelism (tensor.py) and the layer cuts it is made of (shard.py)."""

from llmkit.parallel.shard import resident_bytes
from llmkit.parallel.tensor import Plan, TensorParallel, VocabParallelHead, check, parallelize, plan_of, split_sizes

__all__ = [
    "Plan",
    "TensorParallel",
    "VocabParallelHead",
    "check",
    "parallelize",
    "plan_of",
    "resident_bytes",
    "split_sizes",
]
