"""Pieces shared by the decoder-only and encoder-decoder models: input checks, token embedding with positions,
teacher forcing, the loss record, weight initialisation, and the per-sequence cache bookkeeping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.errors import InputError
from llmkit.layers.attention.mask import AttentionMask
from llmkit.layers.moe import GroupedExperts, MoE, Router
from llmkit.layers.position import LearnedPositions, SinusoidalPositions
from llmkit.layers.rope import RotaryEmbedding


def check_tokens(tokens: Any, vocab_size: int, name: str = "tokens") -> None:
    """Raise InputError unless tokens is a (B, T) integer tensor with ids in [0, vocab_size) and T >= 1."""
    if not isinstance(tokens, Tensor):
        raise InputError(f"{name} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise InputError(f"{name} must have shape (batch, seq_len), got {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise InputError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.shape[1] == 0:
        raise InputError(f"{name} is empty (seq_len 0); give at least one token")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"{name} contains id {bad}, outside the vocabulary [0, {vocab_size})")


def check_mask(mask: Tensor | None, tokens: Tensor, name: str = "padding_mask") -> Tensor | None:
    """Validate a (B, T) padding mask (True or 1 = real token) shaped like tokens; returns it as bool."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(tokens.shape):
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise InputError(
            f"{name} must be a (batch, seq_len) tensor shaped like the tokens {tuple(tokens.shape)}, got {shape}"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.is_complex():
        raise InputError(f"{name} must be bool (True = real token) or 0/1 integers, got dtype {mask.dtype}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise InputError(f"{name} must hold only 0 and 1 (1 = real token)")
    return mask.bool()


def positions_from_mask(valid: Tensor) -> Tensor:
    """Positions of real tokens counted from each row's first real token: (B, T) bool -> (B, T) long."""
    return (valid.long().cumsum(dim=1) - 1).clamp(min=0)


def shift_right(tokens: Tensor, start_id: int, valid: Tensor | None = None) -> Tensor:
    """Teacher forcing inputs: prepend the start token and drop the last token. (B, T) -> (B, T).

    targets  I    love you  </s>
    inputs   <s>  I    love you        the model predicts targets[t] from inputs[: t + 1]

    With `valid` (B, T) (True = real target), the start token goes to each row's first real slot, so left-padded rows
    read  pad pad <s> I love  for targets  pad pad I love you."""
    shifted = torch.cat((torch.full_like(tokens[:, :1], start_id), tokens[:, :-1]), dim=1)
    if valid is None:
        return shifted
    first = valid & ~torch.cat((torch.zeros_like(valid[:, :1]), valid[:, :-1]), dim=1)  # first real slot
    return torch.where(first, torch.full_like(tokens, start_id), shifted)


def teacher_forcing(
    targets: Tensor, start_id: int, valid: Tensor | None, ignore_index: int, vocab_size: int
) -> tuple[Tensor, Tensor]:
    """(inputs, labels) for teacher forcing: inputs are the targets shifted right behind `start_id`; labels are the
    targets with padding replaced by `ignore_index`. The inputs' padding is `valid` itself."""
    if not 0 <= start_id < vocab_size:
        raise InputError(f"start_id={start_id} is outside the vocabulary [0, {vocab_size})")
    if bool((targets == ignore_index).any()):
        raise InputError(
            f"targets contain ignore_index={ignore_index}: with start_id the inputs are built from the targets, so "
            "every target must be a token id. Mark padding with padding_mask, or pass the inputs explicitly"
        )
    check_tokens(targets, vocab_size, "targets")
    labels = targets if valid is None else targets.masked_fill(~valid, ignore_index)
    return shift_right(targets, start_id, valid), labels


def check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 1.0:
        raise InputError(f"label_smoothing={label_smoothing} must be in [0, 1)")


@dataclass(frozen=True)
class LossOutput:
    """The terms of a training loss. `total` is what to backpropagate."""

    total: Tensor
    ce: Tensor  # next-token cross-entropy (nats per token)
    aux: Tensor  # MoE balance + z losses, already weighted by their coefficients
    mtp: Tensor  # multi-token-prediction cross-entropy, mean over depths (unweighted; 0 without MTP)
    n_tokens: int  # target tokens that counted


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, label_smoothing: float = 0.0) -> Tensor:
    """Mean token cross-entropy in fp32. logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        targets.flatten(),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )


def reset_moe_stats(model: nn.Module) -> None:
    """Forget the MoE layers' statistics, so that `moe_aux_loss` sees only the forward calls that follow."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.last_stats = None


def moe_aux_loss(model: nn.Module, cfg: ModelConfig, like: Tensor) -> Tensor:
    """Sum of the MoE layers' balance and z losses from their last forward call, weighted by the config."""
    total = like.new_zeros((), dtype=torch.float32)
    if cfg.moe is None or (cfg.moe.aux_loss_coef == 0 and cfg.moe.z_loss_coef == 0):
        return total
    for m in model.modules():
        if isinstance(m, MoE) and m.last_stats is not None:
            total = total + cfg.moe.aux_loss_coef * m.last_stats.aux_loss + cfg.moe.z_loss_coef * m.last_stats.z_loss
    return total


class InputEmbedding(nn.Module):
    """tokens (B, T), positions (B | 1, T) -> (B, T, C): table lookup (times sqrt(C) when scaled, as in the paper,
    so that embeddings and sinusoids have comparable size), plus additive positions, then dropout."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        p = cfg.position
        self.positions: nn.Module | None
        if p.kind == "sinusoidal":
            self.positions = SinusoidalPositions(cfg.d_model, p.theta, p.layout)
        elif p.kind == "learned":
            self.positions = LearnedPositions(max_seq_len, cfg.d_model)
        else:
            self.positions = None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, table: nn.Embedding, tokens: Tensor, positions: Tensor) -> Tensor:
        x = table(tokens)
        if self.scale != 1.0:
            x = x * self.scale
        if self.positions is not None:
            x = x + self.positions(positions).to(x.dtype)
        return self.dropout(x)


def build_rope(cfg: ModelConfig) -> RotaryEmbedding | None:
    p = cfg.position
    return RotaryEmbedding(cfg.rope_dim, p.theta, p.max_seq_len, p.scaling) if p.kind == "rope" else None


def check_positions(positions: Tensor, cfg: ModelConfig) -> None:
    """Positions must be non-negative integers, and below max_seq_len where a table is indexed."""
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.is_complex():
        raise InputError(f"positions must be integers, got dtype {positions.dtype}")
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0:
        raise InputError(f"positions must be >= 0, got {lo}")
    limit = cfg.position.max_seq_len
    if cfg.position.kind in ("learned", "rope") and hi >= limit:
        raise InputError(f"position {hi} is beyond the model's context: position.max_seq_len={limit}")


def check_cache_args(model: nn.Module, batch: object, max_len: object, dtype: torch.dtype | None) -> torch.dtype:
    """Validate new_cache arguments; returns the cache dtype (the model's unless given, and it must match)."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"new_cache needs {name} to be an int >= 1, got {value!r}")
    model_dtype = next(model.parameters()).dtype
    if dtype is not None and dtype != model_dtype:
        raise InputError(
            f"cache dtype {dtype} differs from the model's {model_dtype}; attention needs both in one dtype "
            "(convert the model with .to(dtype) instead)"
        )
    return model_dtype


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Initialise parameters.

    normal (GPT-2 / LLaMA): weights ~ N(0, init_std); the projections that write into the residual stream
    (attention wo, feed-forward w2) get std / sqrt(2 * n_layers), so the residual's variance does not grow with
    depth. xavier (the original Transformer, torch.nn.Transformer): Glorot-uniform weights, embeddings
    ~ N(0, d_model^-1/2) since they are multiplied by sqrt(d_model). Biases 0, norm gains 1.
    """
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


@dataclass
class SequenceState:
    """Bookkeeping a cache needs across calls: which slots hold real tokens, each row's next position, how many
    slots are filled. New tokens always take slots [length, length + T) in every row (prompts are left-padded)."""

    valid: Tensor  # (B, S_max) bool
    next_position: Tensor  # (B,) long
    length: int = 0
    padded: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def new(cls, batch: int, max_len: int, device: torch.device | None) -> SequenceState:
        return cls(
            valid=torch.zeros(batch, max_len, dtype=torch.bool, device=device),
            next_position=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def advance(self, T: int, valid: Tensor | None) -> tuple[int, Tensor, AttentionMask]:
        """Claim slots for T new tokens; returns (first slot, positions (B, T), causal mask over filled slots)."""
        B, start = self.valid.shape[0], self.length
        if start + T > self.max_len:
            raise InputError(
                f"the cache holds max_len={self.max_len} tokens and {start} are used; {T} more do not fit. "
                "Create the cache with a larger max_len"
            )
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=self.valid.device)
        elif not self.padded and not bool(valid.all()):
            self.padded = True
        self.valid[:, start : start + T] = valid
        positions = (self.next_position[:, None] + valid.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
        self.next_position = self.next_position + valid.long().sum(dim=1)
        self.length = start + T
        keys = self.valid[:, : self.length]  # (B, S)
        mask = AttentionMask(allowed=keys[:, None, None, :], causal=True) if self.padded else AttentionMask(causal=True)
        return start, positions, mask

    def reorder(self, index: Tensor) -> None:
        """Keep rows `index` (B',) in that order (beam search)."""
        self.valid = self.valid.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)

    def discard(self, counts: Tensor) -> None:
        """Forget the last counts[b] filled slots of each row b (rejected speculative tokens): they stop being
        attended to and the row's next position moves back. Their slots stay used; new tokens go after them."""
        n = int(counts.max()) if counts.numel() else 0
        if n == 0:
            return
        span = torch.arange(self.length - n, self.length, device=self.valid.device)  # (n,)
        drop = span.unsqueeze(0) >= (self.length - counts.to(self.valid.device)).unsqueeze(1)  # (B, n)
        self.valid[:, self.length - n : self.length] &= ~drop
        self.next_position = self.next_position - counts.to(self.next_position.device)
        self.padded = True


def seq2seq_teacher_forcing(
    model: Any,
    source: Tensor,
    targets: Tensor,
    start_id: int,
    source_mask: Tensor | None,
    target_mask: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """An encoder-decoder's teacher-forced pass: the decoder reads the targets shifted right behind `start_id` and
    predicts every target token in parallel. Returns (logits (B, T, V), labels (B, T) with pads at ignore_index,
    the mean token cross-entropy)."""
    check_label_smoothing(label_smoothing)
    if not isinstance(targets, Tensor):
        raise InputError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}")
    valid = check_mask(target_mask, targets, "target_mask")
    inputs, labels = teacher_forcing(targets, start_id, valid, ignore_index, model.cfg.vocab_size)
    reset_moe_stats(model)
    logits = model(source, inputs, source_mask=source_mask, target_mask=valid)
    return logits, labels, cross_entropy(logits, labels, ignore_index, label_smoothing)
