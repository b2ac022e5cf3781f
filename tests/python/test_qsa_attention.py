"""qsa_sparse_attention through the Python API, against an independent float64 computation
(qsa_testing.ref_attention_rows), on every query/KV layout the seed names."""

import math

import numpy as np
import pytest
import torch

import sparse_attn
from qsa_testing import (DEVICES, FLOAT_DTYPES, assert_close, backends_for,
                         call_native_or_skip, expand_blocks, needs_cuda, paged_kv_of,
                         padded_kv_of, poisoned, randn, ref_attention_rows, strided_copy)

OUT_TOL = {torch.bfloat16: dict(rtol=1e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}
LSE_TOL = dict(rtol=1e-4, atol=1e-4)


def cases():
    out = []
    for device in ("cpu", "cuda"):
        marks = () if device == "cpu" else needs_cuda
        for backend in backends_for(device):
            for dtype in ("bf16", "fp16"):
                out.append(pytest.param(device, backend, dtype, marks=marks,
                                        id=f"{device}-{backend}-{dtype}"))
    return out


@pytest.mark.parametrize("device,backend,dtype", cases())
@pytest.mark.parametrize("heads", ["24_2_256", "6_2_64", "4_4_32"])
def test_padded_query_padded_kv(device, backend, dtype, heads):
    hq, hkv, d = map(int, heads.split("_"))
    dt = FLOAT_DTYPES[dtype]
    B, Q, S, W = 2, 5, 33, 19
    query = randn((B, Q, hq, d), dt, device)
    key = randn((B, S, hkv, d), dt, device)
    value = randn((B, S, hkv, d), dt, device)
    ids = torch.randint(-3, S + 4, (B, Q, W), dtype=torch.int32, device=device)
    ids[0, 0, :4] = torch.tensor([30, 30, 29, 2], dtype=torch.int32)  # duplicates count
    seq_lens_k = torch.tensor([S, 21], dtype=torch.int32, device=device)
    out, lse = call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention(
        query, key, value, ids, seq_lens_k=seq_lens_k, return_lse=True, backend=backend,
        num_splits=1), backend)
    assert out.shape == query.shape and out.dtype == dt and lse.shape == (B, Q, hq)
    assert lse.dtype == torch.float32
    lens = [S, 21]
    rows = [(b, i) for b in range(B) for i in range(Q)]
    ref, ref_lse = ref_attention_rows(
        query.reshape(B * Q, hq, d), ids.reshape(B * Q, W),
        padded_kv_of(key, value, [b for b, _ in rows]),
        positions=[lens[b] - Q + i for b, i in rows], seq_lens_k=[lens[b] for b, _ in rows],
        active=[True] * len(rows), scale=1 / math.sqrt(d), out_dtype=dt)
    assert_close(out.reshape(B * Q, hq, d), ref, **OUT_TOL[dt])
    assert_close(lse.reshape(B * Q, hq), ref_lse, **LSE_TOL)


@pytest.mark.parametrize("device,backend,dtype", cases())
@pytest.mark.parametrize("rows_by", ["cu_seqlens_q", "token_to_req"])
def test_flattened_query_paged_kv(device, backend, dtype, rows_by):
    dt = FLOAT_DTYPES[dtype]
    hq, hkv, d, page_size = 24, 2, 256, 16
    lens_q, lens_k = [3, 1, 4], [40, 7, 64]
    table = torch.tensor([[4, 0, 2, -1], [1, -1, -1, -1], [3, 6, 9, 5]], dtype=torch.int32,
                         device=device)  # page 9 is out of range: masked
    key = randn((7, page_size, hkv, d), dt, device)
    value = randn((7, page_size, hkv, d), dt, device)
    query = randn((sum(lens_q), hq, d), dt, device)
    b_of_row = [b for b, n in enumerate(lens_q) for _ in range(n)]
    positions = torch.tensor([lens_k[b] - lens_q[b] + i for b, n in enumerate(lens_q)
                              for i in range(n)], dtype=torch.int32, device=device)
    ids = torch.randint(-1, 64, (len(b_of_row), 40), dtype=torch.int32, device=device)
    if rows_by == "cu_seqlens_q":
        meta = dict(cu_seqlens_q=torch.tensor([0, 3, 4, 8], dtype=torch.int32, device=device))
    else:
        meta = dict(token_to_req=torch.tensor(b_of_row, dtype=torch.int32, device=device),
                    num_requests=3)
    out = call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention(
        query, key, value, ids, block_table=table, page_size=page_size,
        seq_lens_k=torch.tensor(lens_k, dtype=torch.int32, device=device),
        query_positions=positions, backend=backend, **meta), backend)
    ref, _ = ref_attention_rows(query, ids, paged_kv_of(key, value, table.cpu(), b_of_row),
                                positions=positions.tolist(),
                                seq_lens_k=[lens_k[b] for b in b_of_row],
                                active=[True] * len(b_of_row), scale=1 / math.sqrt(d),
                                out_dtype=dt)
    assert_close(out, ref, **OUT_TOL[dt])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gate_kind", ["elementwise", "per_head"])
def test_gate_equals_unfused_path(device, gate_kind):
    dt = torch.bfloat16
    B, Q, S, hq, hkv, d = 1, 4, 16, 4, 2, 32
    query = randn((B, Q, hq, d), dt, device)
    key, value = randn((B, S, hkv, d), dt, device), randn((B, S, hkv, d), dt, device)
    ids = torch.randint(0, S, (B, Q, 8), dtype=torch.int32, device=device)
    gate = randn((B, Q, hq, d) if gate_kind == "elementwise" else (B, Q, hq), dt, device, 2.0)
    out = sparse_attn.qsa_sparse_attention(query, key, value, ids, gate=gate, scale=0.2,
                                           backend="reference")
    ref, _ = ref_attention_rows(
        query.reshape(Q, hq, d), ids.reshape(Q, 8), padded_kv_of(key, value, [0] * Q),
        positions=[S - Q + i for i in range(Q)], seq_lens_k=[S] * Q, active=[True] * Q,
        scale=0.2, gate=gate.reshape(Q, *gate.shape[2:]), out_dtype=dt)
    assert_close(out.reshape(Q, hq, d), ref, **OUT_TOL[dt])


@pytest.mark.parametrize("device", DEVICES)
def test_padded_rows_past_seq_lens_q_are_zero_with_lse_minus_inf(device):
    dt = torch.float16
    query = randn((2, 3, 2, 16), dt, device)
    key, value = randn((2, 8, 1, 16), dt, device), randn((2, 8, 1, 16), dt, device)
    ids = torch.arange(8, dtype=torch.int32, device=device).expand(2, 3, 8)
    seq_lens_q = torch.tensor([1, 3], dtype=torch.int32, device=device)
    out, lse = sparse_attn.qsa_sparse_attention(query, key, value, ids, seq_lens_q=seq_lens_q,
                                                return_lse=True, backend="reference")
    assert torch.equal(out[0, 1:], torch.zeros_like(out[0, 1:]))
    assert (lse[0, 1:] == -math.inf).all() and torch.isfinite(lse[0, 0]).all()
    assert torch.isfinite(lse[1]).all()


def every_backend():
    """cases() and the CPU's native backend."""
    return [pytest.param(device, backend, dtype, marks=() if device == "cpu" else needs_cuda,
                         id=f"{device}-{backend}-{dtype}")
            for device in ("cpu", "cuda") for backend in ("reference", "native")
            for dtype in ("bf16", "fp16")]


def graph_padded_batch(device, dt):
    """Two requests (KV lengths 40 and 64, paged) and eight rows, three of them padding rows of a
    graph-padded batch; `pos` holds each real row's right-aligned position (its request's last
    row on its last key) and a position that could be real for each padding row."""
    hq, hkv, d, page_size = 24, 2, 256, 16
    lens_k = [40, 64]
    req = [0, 1, -1, 1, 0, 1, -1, -1]
    seen, pos = {0: 0, 1: 0}, []
    for b in req:
        if b < 0:
            pos.append(5)
            continue
        pos.append(lens_k[b] - req.count(b) + seen[b])
        seen[b] += 1
    return dict(
        req=req, pos=pos, lens_k=lens_k, page_size=page_size, d=d,
        table=torch.tensor([[4, 0, 2, -1], [3, 6, 1, 5]], dtype=torch.int32, device=device),
        key=randn((7, page_size, hkv, d), dt, device),
        value=randn((7, page_size, hkv, d), dt, device),
        query=randn((len(req), hq, d), dt, device),
        ids=torch.randint(-1, 64, (len(req), 40), dtype=torch.int32, device=device))


def run_padded_batch(batch, backend, rows, req, pos, meta_dtype=torch.int32):
    device = batch["query"].device
    meta = lambda values: torch.tensor(values, dtype=meta_dtype, device=device)  # noqa: E731
    return call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention(
        batch["query"][rows], batch["key"], batch["value"], batch["ids"][rows],
        block_table=batch["table"].to(meta_dtype), page_size=batch["page_size"],
        seq_lens_k=meta(batch["lens_k"]), token_to_req=meta([req[r] for r in rows]),
        num_requests=2, query_positions=meta([pos[r] for r in rows]), return_lse=True,
        backend=backend), backend)


def expected_rows(batch, dt, rows, pos):
    return ref_attention_rows(
        batch["query"][rows], batch["ids"][rows],
        paged_kv_of(batch["key"], batch["value"], batch["table"].cpu(),
                    [batch["req"][r] for r in rows]),
        positions=[pos[r] for r in rows], seq_lens_k=[batch["lens_k"][batch["req"][r]]
                                                      for r in rows],
        active=[True] * len(rows), scale=1 / math.sqrt(batch["d"]), out_dtype=dt)


@pytest.mark.parametrize("device,backend,dtype", every_backend())
@pytest.mark.parametrize("mark", ["request_id", "position"])
@pytest.mark.parametrize("meta_dtype", ["int32", "int64"])
def test_padding_rows_of_a_graph_padded_batch(device, backend, dtype, mark, meta_dtype):
    """Rows marked as padding (token_to_req -1, or a live request id at a negative position),
    between and after the real rows, give zero output and LSE -inf, and the real rows get what
    they get without the padding rows (up to rounding: the native schedule depends on the row
    count, so its sums may run in another order); int32 and int64 metadata alike."""
    dt = FLOAT_DTYPES[dtype]
    batch = graph_padded_batch(device, dt)
    req, pos = batch["req"], batch["pos"]
    if mark == "position":  # padding rows carry the last real request's id, at positions < 0
        req = [1 if b < 0 else b for b in req]
        pos = [-1 - r % 3 if b < 0 else p for r, (b, p) in enumerate(zip(batch["req"], pos))]
    real = [r for r, b in enumerate(batch["req"]) if b >= 0]
    pad = [r for r, b in enumerate(batch["req"]) if b < 0]
    meta_dtype = getattr(torch, meta_dtype)
    out, lse = run_padded_batch(batch, backend, list(range(len(req))), req, pos, meta_dtype)
    alone, alone_lse = run_padded_batch(batch, backend, real, req, pos, meta_dtype)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    assert (lse[pad] == -math.inf).all()
    assert_close(out[real], alone, **OUT_TOL[dt])
    assert_close(lse[real], alone_lse, rtol=1e-4, atol=1e-4)
    ref, _ = expected_rows(batch, dt, real, pos)
    assert_close(out[real], ref, **OUT_TOL[dt])


@pytest.mark.parametrize("device,backend,dtype", every_backend())
def test_padding_rows_with_a_live_request_id_cannot_shift_positions(device, backend, dtype):
    """Issue 16's silent wrong answer, reproduced: padding rows that carry a live request id (as
    engines pad CUDA-graph batches) used to count as rows of that request when positions were
    inferred, so the request's real rows sat too early and lost their newest tokens. Positions
    are now never inferred from token_to_req: without query_positions the call raises, naming
    it; with them (the padding rows at a negative position) the real rows are right."""
    dt = FLOAT_DTYPES[dtype]
    batch = graph_padded_batch(device, dt)
    req = [1 if b < 0 else b for b in batch["req"]]  # padding rows carry request 1's id
    pos = [-1 if b < 0 else p for b, p in zip(batch["req"], batch["pos"])]
    rows = list(range(len(req)))
    real = [r for r, b in enumerate(batch["req"]) if b >= 0]
    for r in real:  # each real row selects its three newest tokens
        batch["ids"][r] = -1
        batch["ids"][r, :3] = torch.tensor([pos[r], pos[r] - 1, pos[r] - 2])
    with pytest.raises(ValueError, match=r"^query_positions: required with token_to_req"):
        call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention(
            batch["query"], batch["key"], batch["value"], batch["ids"],
            block_table=batch["table"], page_size=batch["page_size"],
            seq_lens_k=torch.tensor(batch["lens_k"], dtype=torch.int32, device=device),
            token_to_req=torch.tensor(req, dtype=torch.int32, device=device), num_requests=2,
            backend=backend), backend)
    out, _ = run_padded_batch(batch, backend, rows, req, pos)
    ref, _ = expected_rows(batch, dt, real, pos)
    assert_close(out[real], ref, **OUT_TOL[dt])
    # What the old inference computed: request 1's three padding rows counted as its rows put
    # its real rows three positions early (p = seq_len_k - rows_of_request + i), which masks
    # the newest tokens they selected: a different, wrong answer.
    counted = {b: req.count(b) for b in (0, 1)}
    seen = {0: 0, 1: 0}
    shifted = []
    for b in req:
        shifted.append(batch["lens_k"][b] - counted[b] + seen[b])
        seen[b] += 1
    wrong, _ = expected_rows(batch, dt, real, shifted)
    assert (wrong.float() - ref.float()).abs().max() > 0.1


@pytest.mark.parametrize("device,backend,dtype", every_backend())
def test_negative_position_marks_a_padding_row(device, backend, dtype):
    """A row at a negative query position sees no token: zero output and LSE -inf, whatever
    its ids, while the other rows of the call are unaffected."""
    dt = FLOAT_DTYPES[dtype]
    hq, hkv, d, page_size = 24, 2, 256, 16
    table = torch.tensor([[4, 0, 2, 1]], dtype=torch.int32, device=device)
    key = randn((5, page_size, hkv, d), dt, device)
    value = randn((5, page_size, hkv, d), dt, device)
    query = randn((4, hq, d), dt, device)
    ids = torch.arange(40, dtype=torch.int32, device=device).expand(4, 40).contiguous()
    positions = torch.tensor([-1, 39, -7, 20], dtype=torch.int32, device=device)
    out, lse = call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention(
        query, key, value, ids, block_table=table, page_size=page_size,
        seq_lens_k=torch.tensor([40], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32, device=device),
        query_positions=positions, return_lse=True, backend=backend), backend)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert (lse[[0, 2]] == -math.inf).all() and torch.isfinite(lse[[1, 3]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_all_invalid_rows_give_zero_and_minus_inf(device):
    query = randn((4, 2, 16), torch.bfloat16, device)
    key, value = randn((1, 8, 2, 16), torch.bfloat16, device), randn((1, 8, 2, 16),
                                                                     torch.bfloat16, device)
    ids = torch.tensor([[-1, -1], [8, 9], [-5, 100], [7, -1]], dtype=torch.int32, device=device)
    out, lse = sparse_attn.qsa_sparse_attention(query[None], key, value, ids[None],
                                                return_lse=True, backend="reference")
    # rows are at positions 4..7: row 3 sees token 7; the others nothing
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    assert (lse[0, :3] == -math.inf).all()
    assert torch.isfinite(lse[0, 3]).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("device", DEVICES)
def test_physical_selected_kv_indices(device):
    dt = torch.bfloat16
    rows, total_kv, hq, hkv, d = 5, 30, 4, 2, 64
    query = randn((rows, hq, d), dt, device)
    key, value = randn((total_kv, hkv, d), dt, device), randn((total_kv, hkv, d), dt, device)
    sel = torch.randint(-3, total_kv + 3, (rows, 12), dtype=torch.int32, device=device)
    sel[0, :3] = 29  # duplicates kept; no causal filtering
    sel[4] = -1  # empty row
    lse = poisoned((rows, hq), torch.float32, device)
    out = sparse_attn.qsa_sparse_attention(query, key, value, selected_kv_indices=sel, lse=lse,
                                           backend="reference")
    assert isinstance(out, torch.Tensor)  # return_lse=False: lse is written but not returned
    ref, ref_lse = ref_attention_rows(
        query, sel, lambda r: (key.cpu(), value.cpu(), [True] * total_kv),
        positions=[0] * rows, seq_lens_k=[total_kv] * rows, active=[True] * rows,
        scale=1 / math.sqrt(d), out_dtype=dt, causal=False)
    assert_close(out, ref, **OUT_TOL[dt])
    assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_block_indices_hint_gives_the_same_result(device):
    dt = torch.bfloat16
    Q, S, nb = 6, 64, 5
    query = randn((1, Q, 4, 32), dt, device)
    key, value = randn((1, S, 2, 32), dt, device), randn((1, S, 2, 32), dt, device)
    positions = torch.arange(S - Q, S, dtype=torch.int32)
    blocks = torch.stack([torch.randperm((int(p) + 1) // 4)[:nb] for p in positions]).int()
    ids, _ = expand_blocks(blocks, positions)
    plain = sparse_attn.qsa_sparse_attention(query, key, value, ids[None].to(device),
                                             backend="reference")
    hinted = sparse_attn.qsa_sparse_attention(query, key, value, ids[None].to(device),
                                              block_indices=blocks[None].to(device),
                                              backend="reference")
    assert torch.equal(plain, hinted)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_views_and_out_identity(device):
    dt = torch.float16
    B, Q, S, hq, hkv, d = 2, 3, 12, 4, 2, 32
    query = randn((B, Q, hq, d), dt, device)
    key, value = randn((B, S, hkv, d), dt, device), randn((B, S, hkv, d), dt, device)
    ids = torch.randint(-1, S, (B, Q, 7), dtype=torch.int32, device=device)
    expected, expected_lse = sparse_attn.qsa_sparse_attention(query, key, value, ids,
                                                              return_lse=True,
                                                              backend="reference")
    # Batch and query axes of query, ids and out must collapse into one row axis (the seed's
    # rule); everything else may be offset and strided.
    big = poisoned((B, Q, hq + 1, 2 * d), dt, device)
    out = big[:, :, 1:, ::2]
    lse = poisoned((B, Q, hq + 3), torch.float32, device)[..., 1:hq + 1]
    got_out, got_lse = sparse_attn.qsa_sparse_attention(
        strided_copy(query, keep_rows=2), strided_copy(key), strided_copy(value),
        strided_copy(ids, keep_rows=2), return_lse=True, out=out, lse=lse, backend="reference")
    assert got_out is out and got_lse is lse
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    untouched = torch.ones(big.shape, dtype=torch.bool, device=device)
    untouched[:, :, 1:, ::2] = False
    assert torch.isnan(big[untouched]).all()


def test_numpy_inputs():
    rng = np.random.default_rng(0)
    query = rng.standard_normal((1, 2, 2, 16)).astype(np.float16)
    key = rng.standard_normal((1, 6, 1, 16)).astype(np.float16)
    value = rng.standard_normal((1, 6, 1, 16)).astype(np.float16)
    ids = np.array([[[0, 1, 2, -1], [5, 4, 3, 3]]], dtype=np.int32)
    out, lse = sparse_attn.qsa_sparse_attention(query, key, value, ids, return_lse=True,
                                                backend="reference")
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.shape == (1, 2, 2)
    torch_out = sparse_attn.qsa_sparse_attention(
        *(torch.from_numpy(a) for a in (query, key, value, ids)), backend="reference")
    assert np.array_equal(out, torch_out.numpy())


# ------------------------------------------------------------------------------------------
# errors: kind and the argument named
# ------------------------------------------------------------------------------------------

def _args(dtype=torch.bfloat16):
    query = randn((1, 2, 4, 32), dtype, "cpu")
    key = randn((1, 8, 2, 32), dtype, "cpu")
    value = randn((1, 8, 2, 32), dtype, "cpu")
    ids = torch.zeros((1, 2, 3), dtype=torch.int32)
    return query, key, value, ids


@pytest.mark.parametrize("kwargs,kind,name", [
    (dict(scale=0.1, softmax_scale=0.1), ValueError, "softmax_scale"),
    (dict(k_scale=2.0), ValueError, "k_scale"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(num_splits=1.5), TypeError, "num_splits"),
    (dict(warp_specialized=1), TypeError, "warp_specialized"),
    (dict(scale="0.1"), TypeError, "scale"),
    (dict(backend="auto"), ValueError, "backend"),
    (dict(gate=torch.zeros((1, 2, 3), dtype=torch.bfloat16)), ValueError, "gate"),
    (dict(seq_lens_k=torch.zeros(1, dtype=torch.float32)), TypeError, "seq_lens_k"),
    (dict(block_table=[[0]]), TypeError, "block_table"),
], ids=["scale_and_softmax_scale", "k_scale", "num_splits_zero", "num_splits_float",
        "warp_specialized_int", "scale_str", "backend_auto", "gate_shape", "seq_lens_k_float32",
        "block_table_list"])
def test_errors_name_the_argument(kwargs, kind, name):
    with pytest.raises(kind, match=name):
        sparse_attn.qsa_sparse_attention(*_args(), backend=kwargs.pop("backend", "reference"),
                                         **kwargs)


def test_return_lse_must_be_a_bool():
    with pytest.raises(TypeError, match="^return_lse: expected a bool"):
        sparse_attn.qsa_sparse_attention(*_args(), return_lse="yes", backend="reference")


def test_float32_query_is_a_type_error():
    with pytest.raises(TypeError, match="query"):
        sparse_attn.qsa_sparse_attention(*_args(torch.float32), backend="reference")


def test_fp8_compute_dtype_is_not_supported():
    with pytest.raises(ValueError, match="compute_dtype"):
        sparse_attn.qsa_sparse_attention(*_args(), compute_dtype=torch.float8_e4m3fn,
                                         backend="reference")


def test_out_overlapping_query_is_rejected():
    query, key, value, ids = _args()
    with pytest.raises(ValueError, match="out"):
        sparse_attn.qsa_sparse_attention(query, key, value, ids, out=query, backend="reference")


def test_native_on_cpu_runs_the_cpu_backend():
    # The default backend is native; on host tensors that is the CPU backend.
    args = _args()
    got = sparse_attn.qsa_sparse_attention(*args)
    want = sparse_attn.qsa_sparse_attention(*args, backend="reference")
    assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_missing_token_indices_is_a_value_error():
    query, key, value, _ = _args()
    with pytest.raises(ValueError, match="token_indices"):
        sparse_attn.qsa_sparse_attention(query, key, value, backend="reference")
