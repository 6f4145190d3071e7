"""Tables of vectors looked up by index (tokens, learned positions), built as the models need them."""

from __future__ import annotations

import torch
from torch import nn


def token_table(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim), left unfilled when built on the meta device (a model to be loaded, counted or cut):
    nn.Embedding fills its table at construction, and that fill on the meta device imports torch._dynamo, 1.4 s of
    every checkpoint load (the model's own initialisation, models/init.py, fills a real table)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)
