"""XAttention through the Python API: xattn_estimate, find_blocks_chunked,
block_sparse_attn_func (and its paged variant) and Xattention_prefill, against float64
statements of their math (xattn_testing.py)."""

import math

import numpy as np
import pytest
import torch

import sparse_attn
from qsa_testing import FLOAT_DTYPES, assert_close, backends_for, call_native_or_skip, \
    needs_cuda, poisoned, randn, strided_copy
from xattn_testing import cdiv, ref_block_sparse, ref_estimate_sums, ref_select

OUT_TOL = {torch.bfloat16: dict(rtol=1e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3),
           torch.float32: dict(rtol=1e-5, atol=1e-5)}


def cases(dtypes=("bf16", "fp16", "fp32")):
    out = []
    for device in ("cpu", "cuda"):
        marks = () if device == "cpu" else needs_cuda
        for backend in backends_for(device):
            for dtype in dtypes:
                out.append(pytest.param(device, backend, dtype, marks=marks,
                                        id=f"{device}-{backend}-{dtype}"))
    return out


@pytest.mark.parametrize("device,backend,dtype", cases())
@pytest.mark.parametrize("lens", [(300, 300), (130, 520), (256, 256)], ids=lambda x: f"q{x[0]}_k{x[1]}")
def test_estimate_sums_and_selection(device, backend, dtype, lens):
    dt = FLOAT_DTYPES[dtype]
    lq, lk = lens
    q = randn((1, 4, lq, 64), dt, device)
    k = randn((1, 2, lk, 64), dt, device)
    sums, masks = call_native_or_skip(lambda: sparse_attn.xattn_estimate(
        q, k, 128, 8, threshold=0.9, backend=backend), backend)
    assert sums.shape == masks.shape == (1, 4, cdiv(lq, 128), cdiv(lk, 128))
    assert sums.dtype == torch.float32 and masks.dtype == torch.bool
    assert_close(sums, ref_estimate_sums(q, k, 128, 8), rtol=1e-4, atol=1e-5)
    # The selection applied to the op's own sums: exact.
    assert torch.equal(masks.cpu(), ref_select(sums, [0.9] * 4, q_len=lq, k_len=lk))


def test_estimate_options_per_head_threshold_sink_norm_noncausal():
    q = randn((2, 2, 256, 32), torch.float32, "cpu")
    k = randn((2, 2, 384, 32), torch.float32, "cpu")
    thresholds = torch.tensor([0.5, 0.95])
    sums, masks = sparse_attn.xattn_estimate(q, k, 128, 4, norm=2.0, threshold=thresholds,
                                             causal=False, keep_sink=True, keep_recent=True,
                                             backend="reference")
    assert_close(sums, ref_estimate_sums(q, k, 128, 4, norm=2.0, causal=False), rtol=1e-4,
                 atol=1e-5)
    assert torch.equal(masks, ref_select(sums, [0.5, 0.95], causal=False, keep_sink=True,
                                         keep_recent=True, q_len=256, k_len=384))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("current_index", [None, 0, 2])
def test_find_blocks_chunked(causal, current_index):
    q_blocks, k_blocks = 3, 6
    sums = torch.rand((2, 3, q_blocks, k_blocks))
    sums[0, 0, 0, :] = 0.25  # ties
    idx = k_blocks - q_blocks if current_index is None else current_index
    mask = sparse_attn.find_blocks_chunked(sums, idx, 0.8, None, False, causal=causal,
                                           backend="reference")
    if causal:
        end = idx + q_blocks
        expected = torch.zeros_like(mask)
        expected[..., :end] = ref_select(sums[..., :end], [0.8] * 3, causal=True)
    else:
        expected = ref_select(sums, [0.8] * 3, causal=False)
    assert torch.equal(mask, expected)


def test_find_blocks_keep_sink_is_upstreams_causal_rule():
    sums = torch.rand((1, 2, 4, 4))
    sums[..., 0] = 0.0  # block 0 would never be chosen on its sum
    mask = sparse_attn.find_blocks_chunked(sums, 0, 0.5, None, False, keep_sink=True,
                                           backend="reference")
    assert mask[..., 0].all()
    out = torch.ones_like(mask)
    assert sparse_attn.find_blocks_chunked(sums, 0, 0.5, None, False, keep_sink=True,
                                           backend="reference", out=out) is out
    assert torch.equal(out, mask)


def varlen_case(dt, device, lens_q=(200, 129), lens_k=(300, 129), hq=4, hkv=2, d=64):
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *np.cumsum(lens_k)], dtype=torch.int32, device=device)
    q = randn((sum(lens_q), hq, d), dt, device)
    k = randn((sum(lens_k), hkv, d), dt, device)
    v = randn((sum(lens_k), hkv, d), dt, device)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


@pytest.mark.parametrize("device,backend,dtype", cases())
def test_block_sparse_attn_func_head_kinds(device, backend, dtype):
    dt = FLOAT_DTYPES[dtype]
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(dt, device)
    head_mask_type = [1, 0, -1, 1]
    streaming_info = [0, 0, 0, 0, 1, 1, 0, 0]
    blockmask = torch.rand((2, 2, cdiv(mq, 128), cdiv(mk, 128))) < 0.6
    lse = poisoned((q.shape[0], q.shape[1]), torch.float32, device)
    out = call_native_or_skip(lambda: sparse_attn.block_sparse_attn_func(
        q, k, v, cu_q, cu_k, torch.tensor(head_mask_type, dtype=torch.int32),
        torch.tensor(streaming_info, dtype=torch.int32), blockmask.to(device), mq, mk, 0.0,
        deterministic=True, is_causal=True, backend=backend, lse=lse), backend)
    ref, ref_lse = ref_block_sparse(q, k, v, cu_q.tolist(), cu_k.tolist(), head_mask_type,
                                    streaming_info, blockmask, 1 / math.sqrt(64), causal=True)
    assert_close(out, ref.to(dt), **OUT_TOL[dt])
    assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_block_sparse_attn_func_seed_call_noncausal_and_strided():
    # The seed's call: positional, head_mask_type all ones, no streaming info.
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(torch.float16, "cpu", (150,), (150,), 2, 2, 32)
    blockmask = torch.ones((1, 2, 2, 2), dtype=torch.bool)
    blockmask[0, 1, 1, 0] = False
    head_mask_type = torch.ones(2, dtype=torch.int32)
    out = sparse_attn.block_sparse_attn_func(strided_copy(q), strided_copy(k), strided_copy(v),
                                             cu_q, cu_k, head_mask_type, None, blockmask, mq, mk,
                                             p_dropout=0.0, deterministic=True, is_causal=False,
                                             backend="reference")
    ref, _ = ref_block_sparse(q, k, v, cu_q.tolist(), cu_k.tolist(), [1, 1], None, blockmask,
                              1 / math.sqrt(32), causal=False)
    assert_close(out, ref.half(), **OUT_TOL[torch.float16])


def test_paged_variant_equals_varlen():
    dt = torch.bfloat16
    page_size, hq, hkv, d = 64, 4, 2, 64
    lens_q, lens_k = (100, 64), (260, 192)
    q, k, v, cu_q, cu_k, mq, mk = varlen_case(dt, "cpu", lens_q, lens_k, hq, hkv, d)
    blockmask = torch.rand((2, hq, cdiv(mq, 128), cdiv(mk, 128))) < 0.7
    expected = sparse_attn.block_sparse_attn_func(q, k, v, cu_q, cu_k, None, None, blockmask,
                                                  mq, mk, 0.0, is_causal=True,
                                                  backend="reference")
    max_pages = cdiv(max(lens_k), page_size)
    pages = torch.randperm(2 * max_pages)
    table = pages.view(2, max_pages).to(torch.int32)
    k_cache = torch.zeros((2 * max_pages, page_size, hkv, d), dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    for b, n in enumerate(lens_k):
        for t in range(n):
            page, slot = int(table[b, t // page_size]), t % page_size
            k_cache[page, slot] = k[int(cu_k[b]) + t]
            v_cache[page, slot] = v[int(cu_k[b]) + t]
    out = sparse_attn.block_sparse_attn_paged_func(
        q, k_cache, v_cache, table, torch.tensor(lens_k, dtype=torch.int32), cu_q, blockmask,
        mq, mk, backend="reference")
    assert torch.equal(out, expected)


@pytest.mark.parametrize("device,backend,dtype", cases(("bf16", "fp32")))
def test_xattention_prefill_is_estimate_then_block_sparse(device, backend, dtype):
    dt = FLOAT_DTYPES[dtype]
    B, hq, hkv, lq, lk, d = 1, 4, 2, 200, 330, 64
    q = randn((B, hq, lq, d), dt, device)
    k = randn((B, hkv, lk, d), dt, device)
    v = randn((B, hkv, lk, d), dt, device)
    out = call_native_or_skip(lambda: sparse_attn.Xattention_prefill(
        q, k, v, 8, threshold=0.8, backend=backend), backend)
    assert out.shape == q.shape
    _, masks = sparse_attn.xattn_estimate(q, k, 128, 8, threshold=0.8, backend=backend)
    ref, _ = ref_block_sparse(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                              [0, lq], [0, lk], [1] * hq, None, masks.cpu(), 1 / math.sqrt(d),
                              causal=True)
    assert_close(out[0].transpose(0, 1), ref.to(dt), **OUT_TOL[dt])


def test_xattention_prefill_out_and_lse():
    q = randn((1, 2, 128, 32), torch.float16, "cpu")
    k = randn((1, 2, 256, 32), torch.float16, "cpu")
    out = poisoned(q.shape, q.dtype, "cpu")
    lse = poisoned((1, 2, 128), torch.float32, "cpu")
    result = sparse_attn.Xattention_prefill(q, k, k, 8, backend="reference", out=out, lse=lse)
    assert result is out and torch.isfinite(lse).all() and not torch.isnan(out).any()


def test_numpy_estimate():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 128, 16)).astype(np.float32)
    sums, masks = sparse_attn.xattn_estimate(q, q, 128, 8, backend="reference")
    assert isinstance(sums, np.ndarray) and masks.dtype == np.bool_
    assert masks.tolist() == [[[[True]]]]


@pytest.mark.parametrize("call,kind,name", [
    (lambda q: sparse_attn.xattn_estimate(q, q, 128, 8, softmax=False, backend="reference"),
     sparse_attn.NotSupportedError, "softmax"),
    (lambda q: sparse_attn.xattn_estimate(q, q, 128, 8, kdb=2, backend="reference"),
     sparse_attn.NotSupportedError, "kdb"),
    (lambda q: sparse_attn.xattn_estimate(q, q, 128, 8, select_mode="slash", backend="reference"),
     ValueError, "select_mode"),
    (lambda q: sparse_attn.xattn_estimate(q, q, 128, 7, backend="reference"), ValueError,
     "stride"),
    (lambda q: sparse_attn.xattn_estimate(q, q, 128, 8, threshold="high", backend="reference"),
     TypeError, "threshold"),
    (lambda q: sparse_attn.find_blocks_chunked(torch.rand(1, 1, 2, 2), 0, None, 3, False,
                                               backend="reference"),
     sparse_attn.NotSupportedError, "num_to_choose"),
    (lambda q: sparse_attn.find_blocks_chunked(torch.rand(1, 1, 2, 2), 0, 0.9, None, True,
                                               backend="reference"),
     sparse_attn.NotSupportedError, "decoding"),
    (lambda q: sparse_attn.find_blocks_chunked(torch.rand(1, 1, 2, 2), 1.0, 0.9, None, False,
                                               backend="reference"),
     TypeError, "current_index"),
    (lambda q: sparse_attn.block_sparse_attn_func(
        q[0, 0][:, None], q[0, 0][:, None], q[0, 0][:, None],
        torch.tensor([0, 128], dtype=torch.int32), torch.tensor([0, 128], dtype=torch.int32),
        None, None, torch.ones((1, 1, 1, 1), dtype=torch.bool), 128, 128, 0.1,
        backend="reference"), ValueError, "p_dropout"),
    (lambda q: sparse_attn.block_sparse_attn_func(
        q[0, 0][:, None], q[0, 0][:, None], q[0, 0][:, None],
        torch.tensor([0, 128], dtype=torch.int32), torch.tensor([0, 128], dtype=torch.int32),
        None, None, None, 128, 128, 0.0, return_attn_probs=True, backend="reference"),
     sparse_attn.NotSupportedError, "return_attn_probs"),
    (lambda q: sparse_attn.block_sparse_attn_func(
        q[0, 0][:, None], q[0, 0][:, None], q[0, 0][:, None],
        torch.tensor([0, 128], dtype=torch.int32), torch.tensor([0, 128], dtype=torch.int32),
        [1, 1], None, torch.ones((1, 1, 1, 1), dtype=torch.bool), 128, 128, 0.0,
        backend="reference"), ValueError, "head_mask_type"),
    (lambda q: sparse_attn.Xattention_prefill(q, q, q.half(), 8, backend="reference"),
     TypeError, "value"),
], ids=["softmax_false", "kdb", "select_mode", "stride", "threshold_str", "num_to_choose",
        "decoding", "current_index_float", "p_dropout", "return_attn_probs",
        "head_mask_type_length", "value_dtype"])
def test_errors_name_the_argument(call, kind, name):
    q = randn((1, 1, 128, 16), torch.float32, "cpu")
    with pytest.raises(kind, match=name):
        call(q)


@pytest.mark.parametrize("device,backend,dtype", cases(("bf16",)))
@pytest.mark.parametrize("page_size", [96, 800])
def test_xattention_prefill_paged_is_the_prefill_of_the_pages_keys(device, backend, dtype,
                                                                     page_size):
    dt = FLOAT_DTYPES[dtype]
    B, hq, hkv, lq, lk, d = 2, 4, 2, 200, 900, 64
    q = randn((B, hq, lq, d), dt, device)
    per_req = cdiv(lk, page_size)
    # K and V as the two halves of one [pages, page, Hkv, 2 D] cache; request pages shuffled.
    cache = randn((B * per_req + 1, page_size, hkv, 2 * d), dt, device)
    k_cache, v_cache = cache[..., :d], cache[..., d:]
    perm = torch.randperm(B * per_req, generator=torch.Generator().manual_seed(0))
    table = perm.view(B, per_req).to(torch.int32).to(device)
    gather = lambda c: torch.stack([c[table[b].long()].reshape(-1, hkv, d)[:lk] for b in range(B)]
                                   ).transpose(1, 2)
    out = call_native_or_skip(lambda: sparse_attn.xattention_prefill_paged(
        q, k_cache, v_cache, table, lk, 8, threshold=0.8, backend=backend), backend)
    want = sparse_attn.Xattention_prefill(q, gather(k_cache), gather(v_cache), 8, threshold=0.8,
                                          backend=backend)
    assert torch.equal(out, want)


def test_xattention_prefill_paged_names_bad_arguments():
    q = randn((1, 2, 64, 32), torch.float32, "cpu")
    cache = randn((2, 64, 2, 32), torch.float32, "cpu")
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="^k_len"):
        sparse_attn.xattention_prefill_paged(q, cache, cache, table, 129, 8, backend="reference")
    bad_table = torch.tensor([[0, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="^block_table"):
        sparse_attn.xattention_prefill_paged(q, cache, cache, bad_table, 100, 8, backend="reference")
    with pytest.raises(TypeError, match="^k_len"):
        sparse_attn.xattention_prefill_paged(q, cache, cache, table, 100.0, 8, backend="reference")
    with pytest.raises(ValueError, match="^block_size"):
        sparse_attn.xattention_prefill_paged(q, cache, cache, table, 100, 8, block_size=0,
                                             backend="reference")
