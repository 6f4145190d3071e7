import os
import tempfile

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    # verified-checkpoint stamps (llmkit/interop/stamps.py) go to a directory of this run's, not the user's cache
    os.environ["LLMKIT_STAMPS"] = tempfile.mkdtemp(prefix="llmkit-stamps-")
    # without a GPU, llmkit's Triton kernels (llmkit.kernels) run in Triton's interpreter, on CPU tensors: set before
    # any kernel is defined, since triton.jit reads it then
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # under pytest-xdist each worker gets its share of the cores: more threads than cores makes MKL and oneDNN
    # (the RNN's LSTM most of all) spin against each other, several times slower than one thread each
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes the tests start
