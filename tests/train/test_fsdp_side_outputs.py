"""What layers report through an `Extras` (MoE balance losses, expert loads) reaches the caller when FSDP2 wraps the
blocks: FSDP2 rebuilds dataclass arguments that hold tensors needing gradients, so records appended inside a wrapped
block went to a copy, and a mixture's training lost the balance losses and loads of every MoE layer but the first."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import free_port
from torch import nn

from llmkit import build_model, get_preset
from llmkit.layers.extras import Extras


class Loss(nn.Module):
    """The training loss as the root module's forward (what FSDP2 wraps at the root, as the trainer's task does)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, extras: Extras) -> torch.Tensor:
        return self.model.loss(tokens, inputs=tokens, extras=extras).aux


def test_every_moe_layer_reports_through_fsdp_wrapped_blocks():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = build_model(get_preset("mixtral-8x7b-tiny"))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    plain, root = Extras(), Loss(model)
    expected = root(tokens, plain)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(root)
        extras = Extras()
        aux = root(tokens, extras)
    finally:
        dist.destroy_process_group()
    assert [s.layer for s in extras.moe] == [s.layer for s in plain.moe] and len(plain.moe) == model.cfg.n_layers
    assert torch.allclose(aux, expected)
