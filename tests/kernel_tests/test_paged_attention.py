"""The paged-attention kernel (llmkit.kernels.triton_paged) against its reference, on ragged rows whose blocks lie
scattered through the pool. Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so every push checks the same code the GPU runs."""

from __future__ import annotations

import pytest
import torch

from llmkit.errors import InputError
from llmkit.kernels import triton_usable
from llmkit.kernels.paged_attention import PagedRows, paged_attention, paged_attention_reference

pytestmark = pytest.mark.skipif(
    not triton_usable(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
    reason="Triton is not installed (pip install triton: the interpreter runs its kernels on CPU tensors)",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def scattered_rows(starts: list[int], lens: list[int], bs: int, n_blocks: int, spare: int = 0) -> PagedRows:
    """Rows whose blocks are drawn at random from the pool (tables with holes), each table padded with its first
    block to the longest; `spare` widens the grid's bounds beyond the rows (what a captured step passes)."""
    need = [-(-(s + n) // bs) for s, n in zip(starts, lens, strict=True)]
    free = torch.randperm(n_blocks).tolist()
    nb = max(need) + spare
    tables = []
    for n in need:
        t, free = free[:n], free[n:]
        tables.append(t + t[:1] * (nb - n))
    rows = PagedRows.of(torch.tensor(tables), starts, lens, DEVICE)
    if spare:
        rows = PagedRows(rows.table, rows.q_start, rows.q_len, rows.start, rows.max_q_len + spare, nb * bs)
    return rows


def run_both(
    heads: int,
    kv_heads: int,
    starts: list[int],
    lens: list[int],
    dim: int = 16,
    rope_dim: int = 0,
    latent: bool = False,
    bs: int = 4,
    dtype: torch.dtype = torch.float32,
    spare: int = 0,
    **kw: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_blocks = sum(-(-(s + n) // bs) for s, n in zip(starts, lens, strict=True)) + 5
    k = torch.randn(kv_heads, n_blocks, bs, dim, device=DEVICE, dtype=dtype)
    v = k if latent else torch.randn(kv_heads, n_blocks, bs, dim + 8, device=DEVICE, dtype=dtype)
    k_rope = torch.randn(kv_heads, n_blocks, bs, rope_dim, device=DEVICE, dtype=dtype) if rope_dim else None
    rows = scattered_rows(starts, lens, bs, n_blocks, spare)
    q = torch.randn(sum(lens), heads, dim + rope_dim, device=DEVICE, dtype=dtype)
    kw.setdefault("scale", (dim + rope_dim) ** -0.5)
    kernel = paged_attention(q, k, v, rows, k_rope=k_rope, **kw)  # type: ignore[arg-type]
    reference = paged_attention_reference(
        q, k, v, rows, k_rope=k_rope, **{a: b for a, b in kw.items() if a not in ("chunks", "tile_rows")}
    )  # type: ignore[arg-type]
    return kernel.float(), reference.float()


RAGGED = ([5, 0, 11, 30], [1, 7, 3, 1])  # decoding rows and prompt chunks, one from a prompt's start


@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2), (6, 1), (3, 3)], ids=["mha", "gqa2", "gqa4", "mqa", "odd"]
)
def test_grouped_query_rows_of_every_kind(heads: int, kv_heads: int) -> None:
    kernel, reference = run_both(heads, kv_heads, *RAGGED)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 9, 100])
def test_sliding_window(window: int) -> None:
    kernel, reference = run_both(4, 2, [5, 0, 40], [1, 20, 3], window=window)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("chunks", "window"), [(1, None), (2, None), (1, 8), (2, 100)])
def test_keys_from_a_first_position(chunks: int, window: int | None) -> None:
    """An MTP module's keys start at slot 1: with first_key, no query sees the positions before it (within a sliding
    window too)."""
    bs, n_blocks = 4, 40
    k, v = torch.randn(2, n_blocks, bs, 16, device=DEVICE), torch.randn(2, n_blocks, bs, 16, device=DEVICE)
    rows = scattered_rows([0, 5, 60], [1, 4, 1], bs, n_blocks)
    rows = PagedRows(rows.table, rows.q_start, rows.q_len, rows.start, rows.max_q_len, rows.max_keys, first_key=1)
    q = torch.randn(6, 4, 16, device=DEVICE)
    got = paged_attention(q, k, v, rows, 0.25, window=window, chunks=chunks)
    want = paged_attention_reference(q, k, v, rows, 0.25, window=window)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # position 0 alone, before the first key: nothing seen
    full = PagedRows(rows.table, rows.q_start, rows.q_len, rows.start, rows.max_q_len, rows.max_keys)
    assert not torch.allclose(got[1:], paged_attention_reference(q, k, v, full, 0.25, window=window)[1:])


def test_soft_cap() -> None:
    kernel, reference = run_both(4, 2, *RAGGED, softcap=2.0, scale=1.0)  # scores large enough for the cap to bite
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("bs", [1, 3, 16, 64])
def test_block_sizes_below_and_above_the_key_tile(bs: int) -> None:
    kernel, reference = run_both(4, 2, [70, 0, 33], [1, 45, 2], bs=bs)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("chunks", [2, 3, 8])
def test_split_over_keys(chunks: int) -> None:
    """Long contexts in runs of keys combined after (rows shorter than a run per chunk included), with windows and
    caps in the mix."""
    kernel, reference = run_both(4, 2, [130, 3, 70, 0], [1, 1, 4, 9], chunks=chunks)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)
    kernel, reference = run_both(4, 2, [130, 3, 70], [1, 1, 4], chunks=chunks, window=40, softcap=3.0)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


def test_latent_attention_cache() -> None:
    """MLA's absorbed form: one key head of latent + rope dims, the latent its value (the same pool)."""
    kernel, reference = run_both(8, 1, [9, 0, 40], [1, 6, 1], dim=32, rope_dim=16, latent=True, chunks=2)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


def test_half_precision_pools() -> None:
    kernel, reference = run_both(4, 2, *RAGGED, dtype=torch.float16)
    torch.testing.assert_close(kernel, reference, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantized_pools(codes: torch.dtype, dtype: torch.dtype) -> None:
    """--kv-dtype int8 / fp8: codes read in the queries' dtype, each key's scale on its scores and each value's on
    its probability, against the reference's codes times scales, in one pass and in runs, with a window and a cap;
    tokens' scales spread over four orders of magnitude, so a scale applied to the wrong key would show."""
    from llmkit.layers.attention.cache import quantize_kv

    starts, lens, bs = [70, 0, 33, 5], [1, 45, 2, 1], 4
    n_blocks = sum(-(-(s + n) // bs) for s, n in zip(starts, lens, strict=True)) + 5
    spread = 10 ** torch.empty(2, n_blocks, bs, 1).uniform_(-2, 2)
    (k, k_scale), (v, v_scale) = (quantize_kv(torch.randn(2, n_blocks, bs, 16) * spread, codes) for _ in range(2))
    k, k_scale, v, v_scale = (t.to(DEVICE) for t in (k, k_scale, v, v_scale))
    rows = scattered_rows(starts, lens, bs, n_blocks)
    q = torch.randn(sum(lens), 4, 16, device=DEVICE, dtype=dtype) / 10
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-3}
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    for extra in [{}, {"window": 9, "softcap": 30.0}]:
        want = paged_attention_reference(q, k, v, rows, 0.25, **extra, **scales)  # type: ignore[arg-type]
        assert want.sub(paged_attention_reference(q, k.float(), v.float(), rows, 0.25, **extra)).abs().max() > 0.1  # type: ignore[arg-type]
        for chunks in (1, 3):
            got = paged_attention(q, k, v, rows, 0.25, chunks=chunks, **extra, **scales)  # type: ignore[arg-type]
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_pools_in_half_precision_over_a_long_context(codes: torch.dtype) -> None:
    """fp16 queries over 4,096 keys of small values with peaked attention: a value's scale (max |v| / 448 for fp8)
    times a small unnormalised probability falls below fp16's normal numbers, so the scales go on the values (codes
    times scale in fp32, then fp16), never on the probabilities: the output is the reference's to fp16's precision,
    as a pool of fp16 values would give it (measured: 2e-2 of the output with the scales on the probabilities)."""
    from llmkit.layers.attention.cache import quantize_kv

    bs, n = 16, 4096
    (k, k_scale), (v, v_scale) = (quantize_kv(torch.randn(1, n // bs, bs, 64) * m, codes) for m in (0.3, 0.001))
    k, k_scale, v, v_scale = (t.to(DEVICE) for t in (k, k_scale, v, v_scale))
    rows = PagedRows.of(torch.randperm(n // bs)[None], [n - 1], [1], DEVICE)
    q = (torch.randn(1, 2, 64, device=DEVICE) * 10).half()
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    want = paged_attention_reference(q.float(), k, v, rows, 0.125, **scales)  # type: ignore[arg-type]
    got = paged_attention(q, k, v, rows, 0.125, **scales).float()  # type: ignore[arg-type]
    assert (got - want).norm() < 3e-3 * want.norm(), ((got - want).norm() / want.norm()).item()


def test_bounds_wider_than_the_rows() -> None:
    """A captured step's grid is sized by fixed bounds: the programs past a row's queries and keys change nothing."""
    kernel, reference = run_both(4, 2, [5, 17], [1, 1], spare=6, chunks=4)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


def test_a_row_alone_equals_it_among_others_with_fixed_splits_and_tiles() -> None:
    """Batch invariance: with a fixed number of key runs and fixed tiles, a row's output has the same bits alone as
    beside rows of other lengths, prompt chunks included."""
    bs, n_blocks = 4, 64
    k = torch.randn(2, n_blocks, bs, 16, device=DEVICE)
    v = torch.randn(2, n_blocks, bs, 16, device=DEVICE)
    fixed = {"scale": 0.25, "chunks": 2, "tile_rows": 64}
    alone = PagedRows.of(torch.tensor([[3, 9, 4, 60, 7, 2, 8, 1, 30, 31, 40]]), [40], [1], DEVICE)
    q = torch.randn(1, 4, 16, device=DEVICE)
    out_alone = paged_attention(q, k, v, alone, **fixed)  # type: ignore[arg-type]
    table = torch.tensor([[5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18], [3, 9, 4, 60, 7, 2, 8, 1, 30, 31, 40]])
    among = PagedRows.of(table, [0, 40], [20, 1], DEVICE)
    out_among = paged_attention(torch.cat([torch.randn(20, 4, 16, device=DEVICE), q]), k, v, among, **fixed)  # type: ignore[arg-type]
    assert torch.equal(out_among[20:], out_alone)


@pytest.mark.parametrize("window", [None, 7])
def test_a_querys_bits_do_not_depend_on_the_chunk_it_came_in(window: int | None) -> None:
    """The batch-invariant mode's attention (one pass over the keys, one tile shape): the query at position 40
    has the same bits as a decoding row, as the last query of a prompt chunk and in the middle of one, since the
    key tiles its tile reads past it (or before its window) leave its softmax as it was."""
    bs, n_blocks = 4, 64
    k = torch.randn(2, n_blocks, bs, 16, device=DEVICE)
    v = torch.randn(2, n_blocks, bs, 16, device=DEVICE)
    table = torch.tensor([[3, 9, 4, 60, 7, 2, 8, 1, 30, 31, 40, 41, 42]])
    fixed = {"scale": 0.25, "chunks": 1, "tile_rows": 64, "window": window}
    q = torch.randn(20, 4, 16, device=DEVICE)  # the queries of positions 30 .. 49
    outs = []
    for start, n in [(40, 1), (30, 11), (35, 10), (33, 17)]:  # position 40 is query 40 - start
        rows = PagedRows.of(table, [start], [n], DEVICE)
        outs.append(paged_attention(q[start - 30 : start - 30 + n], k, v, rows, **fixed)[40 - start])  # type: ignore[arg-type]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_bad_arguments_are_refused() -> None:
    rows = PagedRows.of(torch.tensor([[0]]), [0], [1], DEVICE)
    k = torch.zeros(2, 1, 4, 16, device=DEVICE)
    with pytest.raises(InputError, match="at least 1"):
        paged_attention(torch.zeros(1, 4, 16, device=DEVICE), k, k, rows, 1.0, chunks=0)
    with pytest.raises(InputError, match="share 2 kv heads"):
        paged_attention(torch.zeros(1, 3, 16, device=DEVICE), k, k, rows, 1.0)
    with pytest.raises(InputError, match="power of two"):
        paged_attention(torch.zeros(1, 4, 16, device=DEVICE), k, k, rows, 1.0, tile_rows=24)
    scale = torch.ones(2, 1, 4, device=DEVICE)
    with pytest.raises(InputError, match="both k_scale and v_scale"):
        paged_attention(torch.zeros(1, 4, 16, device=DEVICE), k.to(torch.int8), k.to(torch.int8), rows, 1.0,
                        k_scale=scale)  # fmt: skip


def test_key_runs_fill_the_gpu_only_where_the_rows_do_not() -> None:
    from llmkit.kernels.paged_attention import chunks_for

    assert chunks_for(1, 8, 8192, programs=264) == 32  # one row, 8 kv heads: 33 runs would fill; 256-key runs: 32
    assert chunks_for(4, 8, 8192, programs=264) == 8
    assert chunks_for(64, 8, 8192, programs=264) == 1  # 512 programs already
    assert chunks_for(1, 8, 300, programs=264) == 1  # too short to cut into 256-key runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_latent_attention_over_each_querys_selected_keys(dtype: torch.dtype) -> None:
    """DeepSeek's sparse attention: each query sees only the positions listed for it (-1 pads a list; a list may
    name a position past the query, which it still does not see), decoding rows and prompt chunks alike."""
    starts, lens = [9, 0, 30], [1, 12, 5]
    bs, n = 4, 6
    n_blocks = sum(-(-(s + q) // bs) for s, q in zip(starts, lens, strict=True)) + 5
    latent = torch.randn(1, n_blocks, bs, 32, device=DEVICE, dtype=dtype)
    rope = torch.randn(1, n_blocks, bs, 8, device=DEVICE, dtype=dtype)
    rows = scattered_rows(starts, lens, bs, n_blocks)
    q = torch.randn(sum(lens), 4, 40, device=DEVICE, dtype=dtype)
    positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, lens, strict=True)])
    select = torch.full((len(positions), n), -1)
    for i, p in enumerate(positions.tolist()):
        chosen = torch.randperm(p + 3)[:n]  # some past the query (even past its row's blocks)
        select[i, : len(chosen)] = chosen
    select[::3, -2:] = -1
    kw = {"scale": 0.2, "k_rope": rope, "select": select.to(DEVICE)}
    kernel = paged_attention(q, latent, latent, rows, chunks=3, **kw)  # type: ignore[arg-type]
    reference = paged_attention_reference(q, latent, latent, rows, **kw)  # type: ignore[arg-type]
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(kernel.float(), reference.float(), **tol)
    dense = paged_attention_reference(q, latent, latent, rows, 0.2, k_rope=rope)
    assert not torch.allclose(reference, dense, atol=1e-3)  # the selection matters
