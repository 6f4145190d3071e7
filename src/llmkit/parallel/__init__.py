"""Models split across processes: tensor parallelism (tensor.py: the plan; splits.py: how each layer splits;
collectives.py: what flows between ranks; shard.py: the cuts of one layer) and launching its processes
(launch.py)."""

from llmkit.parallel.collectives import TensorParallel
from llmkit.parallel.shard import resident_bytes
from llmkit.parallel.splits import VocabParallelHead
from llmkit.parallel.tensor import Plan, check, parallelize, plan_of, split_loader, split_sizes

__all__ = [
    "Plan",
    "TensorParallel",
    "VocabParallelHead",
    "check",
    "parallelize",
    "plan_of",
    "resident_bytes",
    "split_loader",
    "split_sizes",
]
