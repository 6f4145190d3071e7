"""The picture every Transformer tutorial draws: a cross-attention heat map, source words against target words."""

from __future__ import annotations

import os
from pathlib import Path

from llmkit.translate.translator import AttentionMap


def plot_attention(amap: AttentionMap, path: str | os.PathLike[str], title: str = "cross-attention") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = amap.weights.numpy()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * len(amap.source) + 2), max(3.0, 0.4 * len(amap.target) + 1.5)))
    im = ax.imshow(w, cmap="viridis", aspect="auto", vmin=0.0)
    ax.set_xticks(range(len(amap.source)), amap.source, rotation=60, ha="right")
    ax.set_yticks(range(len(amap.target)), amap.target)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
