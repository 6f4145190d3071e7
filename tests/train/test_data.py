"""Training batches from prepared data: a function of the step, split across processes; evaluation windows."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.errors import InputError
from llmkit.train.data import TokenData, eval_offsets, train_batch


def test_batches_are_a_function_of_the_step_and_split_across_processes(tiny_data):
    data = TokenData(tiny_data)
    x1, y1 = train_batch(data, 16, 4, seed=1, step=3, micro=0)
    x2, _ = train_batch(data, 16, 4, seed=1, step=3, micro=0)
    assert (x1 == x2).all() and (x1[:, 1:] == y1[:, :-1]).all()
    halves = [train_batch(data, 16, 2, seed=1, step=3, micro=0, rank=r, world=2)[0] for r in range(2)]
    whole = train_batch(data, 16, 4, seed=1, step=3, micro=0)[0]
    assert (np.concatenate([h.numpy() for h in halves]) == whole.numpy()).all()
    assert not (train_batch(data, 16, 4, seed=1, step=4, micro=0)[0] == x1).all()


def test_eval_windows_cover_the_split():
    offsets = eval_offsets(1000, 10, 10**9)
    assert offsets[0] == 0 and offsets[-1] == 1000 - 11 and len(offsets) == 99
    assert len(eval_offsets(1000, 10, 50)) == 5


def test_incomplete_data_folder(tiny_data, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_data, broken)
    (broken / "val_000.bin").unlink()
    with pytest.raises(InputError, match=r"val_000\.bin is missing"):
        TokenData(broken)
    (broken / "meta.json").unlink()
    with pytest.raises(InputError, match="not a prepared data folder"):
        TokenData(broken)
