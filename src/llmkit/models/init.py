"""Weight initialisation for the Transformer models."""

from __future__ import annotations

import math

import torch
from torch import nn

from llmkit.config import ModelConfig
from llmkit.layers.moe import GroupedExperts, Router


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Initialise parameters.

    normal (GPT-2 / LLaMA): weights ~ N(0, init_std); the projections that write into the residual stream
    (attention wo, feed-forward w2) get std / sqrt(2 * n_layers), so the residual's variance does not grow with
    depth. xavier (the original Transformer, torch.nn.Transformer): Glorot-uniform weights, embeddings
    ~ N(0, d_model^-1/2) since they are multiplied by sqrt(d_model). Biases 0, norm gains 1.
    """
    if all(p.is_meta for p in model.parameters()):
        return  # nothing to fill (a model built on the meta device, to be loaded or counted; 0.5 s at 1.5B)
    std = cfg.init_std
    depth_std = std / math.sqrt(2 * (cfg.n_layers + (cfg.encoder.n_layers if cfg.encoder else 0)))
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear):
            if cfg.init == "xavier":
                nn.init.xavier_uniform_(module.weight)
            else:
                nn.init.normal_(module.weight, 0.0, depth_std if leaf in ("wo", "w2") else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, cfg.d_model**-0.5 if cfg.init == "xavier" else std)
        elif isinstance(module, GroupedExperts):
            for pname, p in module.named_parameters(recurse=False):
                if cfg.init == "xavier":
                    for e in range(p.shape[0]):
                        nn.init.xavier_uniform_(p[e])
                else:
                    nn.init.normal_(p, 0.0, depth_std if pname == "w2" else std)
        elif isinstance(module, Router):
            nn.init.normal_(module.weight, 0.0, std)
