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
        row_invariant_interpreted_dot()
    # under pytest-xdist each worker gets its share of the cores: more threads than cores makes MKL and oneDNN
    # (the RNN's LSTM most of all) spin against each other, several times slower than one thread each
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes the tests start


def row_invariant_interpreted_dot() -> None:
    """Triton's interpreter computes tl.dot with numpy's matmul, that is OpenBLAS, whose kernels on some CPUs (its
    Haswell kernels, which it picks on AMD Zen 5) sum a row differently by its place in the tile: under the
    interpreter a row's bits then depended on the rows before it, and the batch-invariance tests failed on those
    machines only. A compiled tl.dot on a GPU runs one instruction sequence for every row of a tile. Here the
    interpreter's dot becomes a product without BLAS (einsum without optimisation: each output's sum in one order),
    otherwise the same (fp8 inputs widened to fp16, summed in the accumulator's dtype)."""
    import numpy as np

    try:
        from triton.runtime import interpreter
    except ImportError:  # no Triton: the kernel tests skip
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_dot"):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        a_data, b_data = a.data, b.data
        if any(x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating() for x in (a, b)):
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        dtype = d.data.dtype
        product = np.einsum("...ik,...kj->...ij", a_data.astype(dtype), b_data.astype(dtype), optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
