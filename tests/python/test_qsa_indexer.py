"""qsa_indexer_mqa_score, qsa_mqa_prefill / qsa_mqa and qsa_mqa_decode through the Python
API, against independent float64 computations (qsa_testing.ref_*)."""

import math

import numpy as np
import pytest
import torch

import sparse_attn
from sparse_attn import _C
from qsa_testing import (DEVICES, FLOAT_DTYPES, assert_close, backends_for,
                         call_native_or_skip, poisoned, randn, ref_indexer_padded,
                         ref_mqa_decode, ref_mqa_prefill, strided_copy)

TOL = dict(rtol=2e-5, atol=2e-5)
H, D = 4, 128  # the seed's canonical indexer geometry (native requires it)


def cases(device):
    return [pytest.param(device, backend, dtype, id=f"{device}-{backend}-{dtype}")
            for backend in backends_for(device) for dtype in ("bf16", "fp16")]


ALL_CASES = cases("cpu") + [pytest.param(*c.values, marks=DEVICES[1].marks, id=c.id)
                            for c in cases("cuda")]
# Both backends on both devices: native on CPU tensors is the CPU backend.
DEVICE_BACKENDS = [
    pytest.param(device, backend, marks=() if device == "cpu" else DEVICES[1].marks,
                 id=f"{device}-{backend}")
    for device in ("cpu", "cuda") for backend in ("reference", "native")]


# ------------------------------------------------------------------------------------------
# qsa_indexer_mqa_score
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend,dtype", ALL_CASES)
def test_score_padded_matches_float64(device, backend, dtype):
    dt = FLOAT_DTYPES[dtype]
    q = randn((2, 37, H, D), dt, device)
    k = randn((2, 11, D), dt, device)
    out = call_native_or_skip(
        lambda: sparse_attn.qsa_indexer_mqa_score(q, k, backend=backend), backend)
    assert out.dtype == torch.float32 and out.device == q.device
    assert_close(out, ref_indexer_padded(q, k, 1 / math.sqrt(D)), **TOL)


@pytest.mark.parametrize("device,backend,dtype", ALL_CASES)
def test_score_positions_seq_lens_and_scale(device, backend, dtype):
    dt = FLOAT_DTYPES[dtype]
    q = randn((3, 5, H, D), dt, device)
    k = randn((3, 20, D), dt, device)
    positions = torch.randint(0, 90, (3, 5), dtype=torch.int32, device=device)
    seq_lens_q = torch.tensor([5, 2, 0], dtype=torch.int32, device=device)
    out = call_native_or_skip(lambda: sparse_attn.qsa_indexer_mqa_score(
        q, k, query_positions=positions, seq_lens_q=seq_lens_q, score_scale=4.0,
        backend=backend), backend)
    assert_close(out, ref_indexer_padded(q, k, 0.25, positions, seq_lens_q), **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cu_seqlens_q", "token_to_req"])
def test_score_varlen(device, layout):
    lens = [3, 0, 9]
    k = randn((3, 4, D), torch.bfloat16, device)
    q = randn((sum(lens), H, D), torch.bfloat16, device)
    if layout == "cu_seqlens_q":
        meta = dict(cu_seqlens_q=torch.tensor([0, 3, 3, 12], dtype=torch.int32, device=device))
    else:
        ids = [r for r, n in enumerate(lens) for _ in range(n)]
        rank = [i for n in lens for i in range(n)]  # a prefill from each request's first token
        meta = dict(token_to_req=torch.tensor(ids, dtype=torch.int32, device=device),
                    query_positions=torch.tensor(rank, dtype=torch.int32, device=device),
                    num_requests=3)
    out = sparse_attn.qsa_indexer_mqa_score(q, k, backend="reference", **meta)
    assert out.shape == (12, 4)
    start = 0
    for r, n in enumerate(lens):
        ref = ref_indexer_padded(q[None, start:start + n], k[r:r + 1], 1 / math.sqrt(D))[0]
        assert_close(out[start:start + n], ref, **TOL)
        start += n


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("mark", ["request_id", "position"])
@pytest.mark.parametrize("meta_dtype", ["int32", "int64"])
def test_score_padding_rows_of_a_graph_padded_batch(device, backend, mark, meta_dtype):
    """Padding rows of a graph-padded batch (token_to_req -1, or a live request id at a negative
    position) score -inf everywhere, and the real rows get what they get without them; int32
    and int64 metadata alike."""
    k = randn((2, 20, D), torch.bfloat16, device)
    marked = [0, -1, 1, 1, -1, 0, 1, -1] + [0] * 6 + [1] * 5 + [-1]  # 8 real rows a request
    q = randn((len(marked), H, D), torch.bfloat16, device)
    seen, pos = {0: 0, 1: 0}, []
    for b in marked:
        pos.append(seen.get(b, 0) * 9 + 3)
        if b >= 0:
            seen[b] += 1
    req = marked
    if mark == "position":  # padding rows carry request 0's id, at negative positions
        req = [0 if b < 0 else b for b in marked]
        pos = [-1 - r % 4 if b < 0 else p for r, (b, p) in enumerate(zip(marked, pos))]
    meta_dtype = getattr(torch, meta_dtype)

    def run(rows):
        meta = lambda values: torch.tensor(values, dtype=meta_dtype, device=device)  # noqa: E731
        return call_native_or_skip(lambda: sparse_attn.qsa_indexer_mqa_score(
            q[rows], k, token_to_req=meta([req[r] for r in rows]),
            query_positions=meta([pos[r] for r in rows]), num_requests=2, backend=backend),
            backend)

    real = [r for r, b in enumerate(marked) if b >= 0]
    pad = [r for r, b in enumerate(marked) if b < 0]
    out = run(list(range(len(marked))))
    assert (out[pad] == -math.inf).all()
    assert torch.equal(out[real], run(real))


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_score_token_to_req_needs_query_positions(device, backend):
    """A row's position is never counted from token_to_req (a padding row carrying a live id
    would shift it): without query_positions the call raises, naming them."""
    k = randn((2, 20, D), torch.bfloat16, device)
    q = randn((4, H, D), torch.bfloat16, device)
    with pytest.raises(ValueError, match=r"^query_positions: required with token_to_req"):
        call_native_or_skip(lambda: sparse_attn.qsa_indexer_mqa_score(
            q, k, token_to_req=torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=device),
            backend=backend), backend)


@pytest.mark.parametrize("device", DEVICES)
def test_score_paged_masks_missing_pages(device):
    page_size, pages = 4, 5
    cache = randn((pages, page_size, 1, D), torch.float16, device)
    table = torch.tensor([[2, -1, 4], [0, 7, 1]], dtype=torch.int32, device=device)
    q = randn((2, 50, H, D), torch.float16, device)
    out = sparse_attn.qsa_indexer_mqa_score(q, cache, block_table=table, page_size=page_size,
                                            backend="reference")
    # The logical keys behind the table, with missing pages as NaN rows that must stay masked.
    logical = torch.full((2, 3 * page_size, D), float("nan"), dtype=torch.float64)
    for b in range(2):
        for j in range(3):
            page = int(table[b, j])
            if 0 <= page < pages:
                logical[b, j * page_size:(j + 1) * page_size] = cache[page, :, 0].double().cpu()
    ref = ref_indexer_padded(q, logical, 1 / math.sqrt(D))
    ref = torch.where(torch.isnan(ref), torch.full_like(ref, -math.inf), ref)
    assert_close(out, ref, **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_score_strided_inputs_and_out_view(device):
    q = randn((2, 9, H, D), torch.bfloat16, device)
    k = randn((2, 6, D), torch.bfloat16, device)
    big = poisoned((4, 12, 10), torch.float32, device)
    out_view = big[1:3, 2:11, 3:9]
    result = sparse_attn.qsa_indexer_mqa_score(strided_copy(q), strided_copy(k),
                                               backend="reference", out=out_view)
    assert result is out_view
    assert_close(out_view, ref_indexer_padded(q, k, 1 / math.sqrt(D)), **TOL)
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[1:3, 2:11, 3:9] = False
    assert torch.isnan(big[outside]).all(), "elements around the out view were written"


# ------------------------------------------------------------------------------------------
# qsa_mqa_prefill / qsa_mqa
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend,dtype", ALL_CASES)
@pytest.mark.parametrize("k_rank", [2, 3])
def test_prefill_matches_float64(device, backend, dtype, k_rank):
    dt = FLOAT_DTYPES[dtype]
    rows, keys = 23, 40
    q = randn((rows, H, D), dt, device)
    k = randn((keys, D) if k_rank == 2 else (keys, 1, D), dt, device)
    starts = torch.randint(-2, 30, (rows,), dtype=torch.int32, device=device)
    ends = starts + torch.randint(-1, 20, (rows,), dtype=torch.int32, device=device)
    out = call_native_or_skip(
        lambda: sparse_attn.qsa_mqa_prefill(q, k, starts, ends, backend=backend), backend)
    assert_close(out, ref_mqa_prefill(q, k, starts.clamp_min(0), ends, 1 / math.sqrt(D)), **TOL)
    alias = sparse_attn.qsa_mqa(q, k, starts, ends, backend=backend)
    assert torch.equal(alias, out)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_score_scale_positional_and_strided(device):
    q = randn((7, H, D), torch.float16, device)
    k = randn((12, D), torch.float16, device)
    starts = torch.zeros(7, dtype=torch.int32, device=device)
    ends = torch.arange(1, 8, dtype=torch.int32, device=device)
    out = poisoned((7, 12), torch.float32, device)
    result = sparse_attn.qsa_mqa_prefill(strided_copy(q), strided_copy(k), strided_copy(starts),
                                         ends, 2.0, backend="reference", out=out)
    assert result is out
    assert_close(out, ref_mqa_prefill(q, k, starts, ends, 0.5), **TOL)


# ------------------------------------------------------------------------------------------
# qsa_mqa_decode
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend,dtype", ALL_CASES)
@pytest.mark.parametrize("page_size", [5, 8, 16, 64])
def test_decode_matches_float64(device, backend, dtype, page_size):
    dt = FLOAT_DTYPES[dtype]
    B, pages, max_pages = 3, 6, 4
    q = randn((B, 1, H, D), dt, device)
    cache = randn((pages, page_size, 1, D), dt, device)
    table = torch.tensor([[0, 3, -1, 5], [1, 2, 4, 9], [5, -1, -1, -1]], dtype=torch.int32,
                         device=device)
    lens = torch.tensor([3 * page_size, max_pages * page_size - 1, 0], dtype=torch.int32,
                        device=device)
    width = max_pages * page_size + 5
    out = call_native_or_skip(
        lambda: sparse_attn.qsa_mqa_decode(q, cache, table, lens, width, backend=backend),
        backend)
    assert out.shape == (B, width)
    assert_close(out, ref_mqa_decode(q, cache, table, lens, width, 1 / math.sqrt(D)), **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_broadcast_query_and_rank3_cache(device):
    q_one = randn((1, H, D), torch.bfloat16, device)
    q = q_one.expand(4, H, D)  # stride 0 on the batch axis
    cache = randn((3, 8, D), torch.bfloat16, device)
    table = torch.tensor([[0, 1], [2, 0], [1, -1], [2, 2]], dtype=torch.int32, device=device)
    lens = torch.tensor([16, 9, 8, 1], dtype=torch.int32, device=device)
    out = sparse_attn.qsa_mqa_decode(q, cache, table, lens, 16, scale=0.1, backend="reference")
    assert_close(out, ref_mqa_decode(q, cache, table, lens, 16, 0.1), **TOL)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("rows", [2, 4, 6])
@pytest.mark.parametrize("page_size", [16, 200])
def test_multi_token_decode_rows_see_their_own_context(device, backend, rows, page_size):
    """Multi-token decode: q [B, R, H, D] and one count of visible compressed keys per query row
    (a speculative step's consecutive counts, padding rows at 0 and below, counts past the page
    table and the output); request b's row r is output row b * R + r. Native CUDA takes up to
    4 rows per request, the host backends any number."""
    B, pages, max_pages = 3, 6, 3
    cap = max_pages * page_size
    q = randn((B, rows, H, D), torch.bfloat16, device)
    cache = randn((pages, page_size, 1, D), torch.bfloat16, device)
    table = torch.tensor([[0, 3, -1], [1, 2, 9], [5, 4, 0]], dtype=torch.int32, device=device)
    per_row = [[cap - 5, cap - 4, cap - 3, cap - 2, cap - 1, cap],
               [0, cap + 7, -1, page_size + 1, 4, 0],
               [5, 0, 2 * page_size, 1, cap + 3, cap // 2]]
    lens = torch.tensor([counts[:rows] for counts in per_row], dtype=torch.int64, device=device)
    width = cap + 3

    def run(backend):
        return sparse_attn.qsa_mqa_decode(q, cache, table, lens, width, backend=backend)

    if device == "cuda" and backend == "native" and rows > 4:
        with pytest.raises(sparse_attn.NotSupportedError,
                           match=rf"^q: backend 'native' takes at most 4 query rows per request, "
                                 rf"got R = {rows} .*; pass backend='reference'"):
            run(backend)
        return
    out = run(backend)
    assert out.shape == (B * rows, width) and out.device == q.device
    assert_close(out, ref_mqa_decode(q, cache, table, lens, width, 1 / math.sqrt(D)), **TOL)
    if device == "cpu" and backend == "native":
        assert torch.equal(out, run("reference"))  # the CPU backend sums in the reference's order


@pytest.mark.parametrize("device", DEVICES)
def test_decode_one_row_takes_context_lens_of_b_or_b_by_1(device):
    q = randn((3, H, D), torch.float16, device)
    cache = randn((4, 8, D), torch.float16, device)
    table = torch.tensor([[0, 1], [2, -1], [3, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([16, 5, 0], dtype=torch.int32, device=device)
    per_request = sparse_attn.qsa_mqa_decode(q, cache, table, lens, 16, backend="reference")
    for q_form in (q, q[:, None]):
        per_row = sparse_attn.qsa_mqa_decode(q_form, cache, table, lens[:, None], 16,
                                             backend="reference")
        assert torch.equal(per_row, per_request)


def test_decode_shape_is_b_times_r_rows():
    q = torch.zeros((5, 3, H, D), dtype=torch.bfloat16)
    assert tuple(_C.qsa_mqa_decode_shape(q, 17)) == (15, 17)
    assert tuple(_C.qsa_mqa_decode_shape(q[:, 0], 17)) == (5, 17)
    assert tuple(_C.qsa_mqa_decode_shape(q[:, :1], 17)) == (5, 17)
    # numpy takes the wrappers' general allocation path.
    out = sparse_attn.qsa_mqa_decode(
        q.half().numpy(), torch.zeros((2, 4, D), dtype=torch.float16).numpy(),
        np.zeros((5, 1), dtype=np.int32), np.ones((5, 3), dtype=np.int64), 17,
        backend="reference")
    assert isinstance(out, np.ndarray) and out.shape == (15, 17)
    assert np.isinf(out[:, 1:]).all() and np.isfinite(out[:, 0]).all()


def test_multi_token_decode_needs_a_context_len_per_row():
    q = randn((2, 3, H, D), torch.bfloat16, "cpu")
    cache = randn((3, 8, 1, D), torch.bfloat16, "cpu")
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)

    def decode(q, lens):
        return sparse_attn.qsa_mqa_decode(q, cache, table, lens, 16, backend="reference")

    with pytest.raises(ValueError, match=(
            r"^context_lens: expected shape \[B, R\] = \[2, 3\]: each query row of multi-token "
            r"decode sees its own number of compressed keys \(a \[B\] count cannot say which "
            r"keys the later rows see\), got \[2\]$")):
        decode(q, torch.tensor([9, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^context_lens: expected shape \[2, 3\] .*got \[2, 2\]"):
        decode(q, torch.ones((2, 2), dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^q: expected at least one query row per request"):
        decode(q[:, :0], torch.ones((2, 0), dtype=torch.int32))
    lens = torch.ones((2, 3), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^out: expected shape \[6, 16\]"):
        sparse_attn.qsa_mqa_decode(q, cache, table, lens, 16, backend="reference",
                                   out=torch.empty((2, 16)))


# ------------------------------------------------------------------------------------------
# numpy, dtypes, errors
# ------------------------------------------------------------------------------------------

def test_numpy_inputs_give_numpy_outputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, H, D)).astype(np.float16)
    k = rng.standard_normal((6, D)).astype(np.float16)
    starts = np.zeros(5, dtype=np.int32)
    ends = np.array([0, 1, 3, 6, 6], dtype=np.int32)
    out = sparse_attn.qsa_mqa_prefill(q, k, starts, ends, backend="reference")
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    ref = ref_mqa_prefill(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(starts),
                          torch.from_numpy(ends), 1 / math.sqrt(D))
    assert_close(torch.from_numpy(out), ref, **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_queries_are_a_type_error(device):
    q = randn((2, 3, H, D), torch.float32, device)
    k = randn((2, 4, D), torch.float32, device)
    with pytest.raises(TypeError, match="q_idx"):
        sparse_attn.qsa_indexer_mqa_score(q, k, backend="reference")


def _prefill_args(dtype=torch.bfloat16):
    q = randn((4, H, D), dtype, "cpu")
    k = randn((6, D), dtype, "cpu")
    return q, k, torch.zeros(4, dtype=torch.int32), torch.full((4,), 6, dtype=torch.int32)


def test_scale_and_score_scale_together_is_a_value_error():
    with pytest.raises(ValueError, match="scale"):
        sparse_attn.qsa_mqa_prefill(*_prefill_args(), 2.0, scale=0.5, backend="reference")


def test_float_metadata_is_a_type_error_naming_it():
    q, k, starts, ends = _prefill_args()
    with pytest.raises(TypeError, match="^row_ends: expected dtype int32 or int64"):
        sparse_attn.qsa_mqa_prefill(q, k, starts, ends.float(), backend="reference")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_int64_metadata_gives_the_int32_scores(device, backend):
    """Engines keep metadata in int64; it is read as stored, with the int32 call's results."""
    dt = torch.bfloat16
    q = randn((5, H, D), dt, device)
    k = randn((40, D), dt, device)
    starts = torch.tensor([0, 3, -2, 7, 30], dtype=torch.int32, device=device)
    ends = torch.tensor([5, 3, 40, 99, 2**31 - 1], dtype=torch.int32, device=device)
    prefill = [call_native_or_skip(lambda: sparse_attn.qsa_mqa_prefill(
        q, k, starts.to(dtype), ends.to(dtype), backend=backend), backend)
        for dtype in (torch.int32, torch.int64)]
    assert torch.equal(prefill[0], prefill[1])
    cache = randn((6, 8, 1, D), dt, device)
    table = torch.tensor([[5, -1, 2], [0, 9, 1], [3, 4, 4], [1, 1, -1], [2, 0, 5]],
                         dtype=torch.int32, device=device)
    lens = torch.tensor([24, 0, 17, 30, 9], dtype=torch.int32, device=device)
    decode = [call_native_or_skip(lambda: sparse_attn.qsa_mqa_decode(
        q, cache, table.to(dtype), lens.to(dtype), 32, backend=backend), backend)
        for dtype in (torch.int32, torch.int64)]
    assert torch.equal(decode[0], decode[1])


def test_float_where_a_tensor_goes_is_a_type_error_naming_it():
    q, k, starts, ends = _prefill_args()
    with pytest.raises(TypeError, match="^row_starts: expected a tensor"):
        sparse_attn.qsa_mqa_prefill(q, k, 0.0, ends, backend="reference")
    with pytest.raises(TypeError, match="^q: expected a tensor"):
        sparse_attn.qsa_mqa_prefill(1.5, k, starts, ends, backend="reference")


def test_tensor_where_a_float_goes_is_a_type_error_naming_it():
    q, k, starts, ends = _prefill_args()
    with pytest.raises(TypeError, match="^scale: expected a float"):
        sparse_attn.qsa_mqa_prefill(q, k, starts, ends, scale=torch.tensor(0.5),
                                    backend="reference")
    with pytest.raises(TypeError, match="^max_model_len: expected an int"):
        sparse_attn.qsa_mqa_decode(q, k[None, :, None], torch.zeros((4, 1), dtype=torch.int32),
                                   starts, 6.0, backend="reference")


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="backend"):
        sparse_attn.qsa_mqa_prefill(*_prefill_args(), backend="triton")


def test_native_backend_on_cpu_runs_the_cpu_backend():
    # Products of 16-bit values are exact in FP32 and both sum in order: the same bits.
    args = _prefill_args()
    got = sparse_attn.qsa_mqa_prefill(*args)
    want = sparse_attn.qsa_mqa_prefill(*args, backend="reference")
    assert torch.equal(got, want)


def test_wrong_rank_query_is_a_value_error_from_cpp():
    q, k, starts, ends = _prefill_args()
    with pytest.raises(ValueError, match="q"):
        sparse_attn.qsa_mqa_prefill(q[0], k, starts, ends, backend="reference")
    with pytest.raises(ValueError, match="q_idx"):
        sparse_attn.qsa_indexer_mqa_score(q[0], k, backend="reference")


def test_read_only_numpy_out_is_rejected():
    q, k, starts, ends = (np.asarray(t) if t.dtype != torch.bfloat16 else t.half().numpy()
                          for t in _prefill_args())
    out = np.zeros((4, 6), dtype=np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^out: .*read-only"):
        sparse_attn.qsa_mqa_prefill(q, k, starts, ends, backend="reference", out=out)


def test_overlapping_out_is_rejected():
    q, k, starts, ends = _prefill_args(torch.float16)
    storage = torch.zeros(4 * 6 * 2, dtype=torch.float32)
    out = storage[:24].view(4, 6)
    with pytest.raises(ValueError, match="out"):
        sparse_attn.qsa_mqa_prefill(q, k, starts, storage[:4].view(torch.int32), backend="reference",
                                    out=out)


def test_tensor_requiring_grad_is_read_without_autograd():
    # There is no backward: the values are read as they are, and the output carries no graph.
    q, k, starts, ends = _prefill_args(torch.float16)
    plain = sparse_attn.qsa_mqa_prefill(q, k, starts, ends, backend="reference")
    graded = sparse_attn.qsa_mqa_prefill(q.clone().requires_grad_(), k, starts, ends,
                                         backend="reference")
    assert torch.equal(plain, graded) and not graded.requires_grad


@pytest.mark.parametrize("width", [-5, 2**31, 2**62, 2**63], ids=["neg", "2e31", "2e62", "2e63"])
def test_bad_max_model_len_is_a_value_error_naming_it(width):
    # Checked before the output of that width is allocated (torch would raise its own
    # RuntimeError or TypeError, or run out of memory).
    q, k, starts, _ = _prefill_args()
    with pytest.raises(ValueError, match="^max_model_len: "):
        sparse_attn.qsa_mqa_decode(q, k[None, :, None], torch.zeros((4, 1), dtype=torch.int32),
                                   starts, width, backend="reference")
