"""Drafters made out of a pretrained model, before any training: a grafted MTP module (self-speculative decoding) or
a pruned copy (a separate draft model).

    graft_mtp(model, depth)   the model with `depth` new MTP modules, each starting from what the model computes
    prune(model, keep)        the model with blocks `keep` only (its embedding, final norm and head kept)

A new MTP module reads the model's normed state h_i and the embedding of token i + 1 through its projection
proj [emb ; h] and predicts token i + 2 (DeepSeek-V3, section 2.2). Grafted, its block starts as a copy of the last
block (a block that already reads this model's states) and its projection as [0 ; I], so at first the block sees the
model's normed state unchanged, as the copied last block expects, and learns how much of the next token's embedding
to mix in. The pruned draft keeps the first blocks, which build the representation, and the last, which the head
reads, as layer-skipping drafts do (Draft & Verify, Zhang et al. 2024; LayerSkip, Elhoushi et al. 2024).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from llmkit.config import ModelConfig
from llmkit.errors import InputError
from llmkit.layers.mtp import MTPModule
from llmkit.models import DecoderLM, build_model


@torch.no_grad()
def graft_mtp(model: DecoderLM, depth: int = 1, cfg: ModelConfig | None = None) -> DecoderLM:
    """A new model (on `model`'s device and dtype, in eval mode) with `model`'s weights and `depth` new MTP modules,
    each a graft: its block a copy of the last block, its projection [0 ; I]. `cfg`: the new model's config when it
    differs from `model`'s in training settings (dropout, loss coefficients); its mtp_depth is `depth`."""
    if len(model.mtp):
        raise InputError(f"the model already has {len(model.mtp)} MTP module(s): graft onto one without")
    if depth < 1:
        raise InputError(f"depth={depth}: graft at least one MTP module")
    p = next(model.parameters())
    out = build_model(dataclasses.replace(cfg or model.cfg, mtp_depth=depth), device=p.device, dtype=p.dtype)
    assert isinstance(out, DecoderLM)
    missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing)  # the trunk whole, the modules new
    C = model.cfg.d_model
    for module in out.mtp:
        assert isinstance(module, MTPModule)
        module.block.load_state_dict(model.blocks[-1].state_dict())
        module.proj.weight.zero_()  # (C, 2C): [emb ; h] -> C
        module.proj.weight[:, C:] = torch.eye(C, device=p.device, dtype=p.dtype)
    return out.eval()


def prune(model: DecoderLM, keep: Sequence[int]) -> DecoderLM:
    """A new model of `model`'s family with its blocks `keep` (in that order) and the rest of its weights (embedding,
    final norm, head), without MTP modules."""
    n = model.cfg.n_layers
    if not keep or len(set(keep)) != len(keep) or any(not 0 <= i < n for i in keep):
        raise InputError(f"keep={list(keep)} must name distinct blocks among the model's {n}")
    p = next(model.parameters())
    out = build_model(dataclasses.replace(model.cfg, n_layers=len(keep), mtp_depth=0), device=p.device, dtype=p.dtype)
    assert isinstance(out, DecoderLM)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("blocks.", "mtp."))}
    for j, i in enumerate(keep):
        state.update({f"blocks.{j}.{k}": v for k, v in model.blocks[i].state_dict().items()})
    out.load_state_dict(state)
    return out.eval()
