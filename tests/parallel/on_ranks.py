"""What the torchrun workers of tests/parallel share: start gloo, one thread a process, compute, and rank 0 writes
the results (JSON) to argv[1]."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def run(compute: Callable[[], list[dict]]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    results = compute()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
