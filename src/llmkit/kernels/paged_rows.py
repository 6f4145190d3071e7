"""Where a step's rows are, for the paged-attention kernel (llmkit.kernels.paged_attention): each row's block table,
its packed queries and the position of its first one. Shapes: B rows, nb blocks in a row's table."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PagedRows:
    """Where a step's rows are: table (B, nb) int32 physical blocks of each row; q_start (B,) int32 each row's first
    packed query; q_len (B,) int32 its queries; start (B,) int32 the position of its first query (its cached keys
    before this step). max_q_len and max_keys bound q_len and start + q_len over the rows: the kernel's grid is
    sized by them, so a captured step (CUDA graphs) passes fixed bounds. first_key: the lowest position any query
    sees (an MTP module's keys start at slot 1: position j is kept in slot j + 1)."""

    table: Tensor
    q_start: Tensor
    q_len: Tensor
    start: Tensor
    max_q_len: int
    max_keys: int
    first_key: int = 0

    @classmethod
    def of(cls, table: Tensor, starts: list[int], lengths: list[int], device: torch.device) -> PagedRows:
        """Rows of `lengths` new queries from positions `starts`, packed in that order."""
        q_start = [0]
        for n in lengths[:-1]:
            q_start.append(q_start[-1] + n)

        def i32(values: list[int]) -> Tensor:
            return torch.tensor(values, device=device, dtype=torch.int32)

        return cls(
            table.to(device=device, dtype=torch.int32),
            i32(q_start),
            i32(lengths),
            i32(starts),
            max(lengths),
            max(s + n for s, n in zip(starts, lengths, strict=True)),
        )
