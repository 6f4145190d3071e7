"""What a user sees of a run: metrics as JSON lines and TensorBoard events, and a loss-curve PNG.

    OUT/metrics.jsonl     one JSON object per logged step ({"step", "loss", "lr", "tokens_per_s", "mfu", ...}) and
                          per evaluation ({"step", "val_loss", "val_ppl", "val_bpc"})
    OUT/tensorboard/      the same scalars for `tensorboard --logdir OUT/tensorboard`
    OUT/loss.png          training and validation loss against tokens, redrawn at each evaluation

Bits per character: val_loss (nats per token) / ln 2 * tokens / characters of the validation split. Unlike loss per
token, it compares models with different tokenizers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def bits_per_char(loss_nats_per_token: float, chars_per_token: float) -> float:
    return loss_nats_per_token / math.log(2) / chars_per_token


class MetricsLog:
    """Appends metrics to metrics.jsonl and TensorBoard; redraws loss.png on request. Only process 0 writes."""

    def __init__(self, out: Path, enabled: bool = True, tensorboard: bool = True) -> None:
        self.out = out
        self.enabled = enabled
        self.train: list[tuple[int, float]] = []  # (tokens, loss)
        self.val: list[tuple[int, float]] = []
        self._writer: Any = None
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            self._read_existing()
            if tensorboard:
                try:
                    from tensorboardX import SummaryWriter

                    self._writer = SummaryWriter(str(out / "tensorboard"))
                except ImportError:
                    self._writer = None

    def _read_existing(self) -> None:
        """On resume, keep the curve so far (and drop entries past the resumed step later, in truncate)."""
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if "loss" in row:
                self.train.append((row["tokens"], row["loss"]))
            if "val_loss" in row:
                self.val.append((row["tokens"], row["val_loss"]))

    def truncate(self, step: int) -> None:
        """Forget entries logged after `step` (a run resumed from an earlier checkpoint redoes them)."""
        if not self.enabled:
            return
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue
        path.write_text("".join(k + "\n" for k in keep))
        self.train, self.val = [], []
        self._read_existing()

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        if "loss" in row:
            self.train.append((row["tokens"], row["loss"]))
        if "val_loss" in row:
            self.val.append((row["tokens"], row["val_loss"]))
        if self._writer is not None:
            for k, v in row.items():
                if k not in ("step", "tokens", "time") and isinstance(v, (int, float)) and math.isfinite(v):
                    self._writer.add_scalar(k, v, row["step"])
            self._writer.flush()

    def plot(self, title: str = "") -> Path | None:
        """Redraw OUT/loss.png (written to a temporary file, then renamed)."""
        if not self.enabled or not self.train:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        t, loss = zip(*self.train, strict=True)
        ax.plot([x / 1e6 for x in t], loss, color="tab:blue", alpha=0.35, linewidth=0.8, label="train")
        if len(loss) >= 5:
            k = max(1, len(loss) // 25)
            smooth = [sum(loss[max(0, i - k) : i + 1]) / len(loss[max(0, i - k) : i + 1]) for i in range(len(loss))]
            ax.plot([x / 1e6 for x in t], smooth, color="tab:blue", linewidth=1.6, label="train (smoothed)")
        if self.val:
            vt, vl = zip(*self.val, strict=True)
            ax.plot([x / 1e6 for x in vt], vl, "o-", color="tab:orange", linewidth=1.6, label="validation")
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = self.out / "loss.tmp.png"
        fig.savefig(tmp)
        plt.close(fig)
        tmp.replace(self.out / "loss.png")
        return self.out / "loss.png"

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
