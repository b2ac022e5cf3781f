"""FP8 e4m3 caches (docs/qsa.md, "FP8 caches"): torch.float8_e4m3fn K/V and indexer keys, and
uint8 views of them with kv_cache_dtype named, on the reference and CPU backends against
float64 oracles on the dequantised values (stored value x scale, the product in FP32); the
argument errors; native CUDA FP8 attention against the reference, and the native CUDA indexer
ops with FP8 keys against the same oracles."""

import inspect
import math

import pytest
import torch

import sparse_attn
from qsa_testing import (assert_close, needs_cuda, paged_kv_of, randn,
                         ref_attention_rows, ref_indexer_padded, ref_mqa_decode, ref_mqa_prefill)

F8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
I32 = torch.int32
OUT_TOL = dict(rtol=1e-2, atol=1e-2)
LSE_TOL = dict(rtol=1e-4, atol=1e-4)
HOST_BACKENDS = ["reference", "native"]  # native on CPU tensors is the CPU backend
# How the caller hands over FP8 bytes: the float8 dtype, or uint8 storage with the format named
# by each of the accepted spellings.
FORMS = ["float8", "fp8", "fp8_e4m3", "torch.float8_e4m3fn"]


def stored(t, form):
    """(tensor, kv_cache_dtype) passing the FP8 tensor t in the given form."""
    if form == "float8":
        return t, None
    return t.view(torch.uint8), F8 if form == "torch.float8_e4m3fn" else form


def fp8_randn(shape, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(F8)


def dequantised(t, scale):
    return t.float() * torch.tensor(scale, dtype=torch.float32)


def test_every_code_decodes_as_torch_does():
    # One query row attending to a single token: the output is that token's V exactly (FP8
    # values are exact in bfloat16), so the 256 codes laid along D come back through the binding.
    codes = torch.arange(256, dtype=torch.uint8)
    value = codes.view(F8).reshape(1, 1, 1, 256)
    key = torch.zeros((1, 1, 1, 256), dtype=F8)
    query = torch.zeros((1, 1, 1, 256), dtype=BF16)
    ids = torch.zeros((1, 1, 1), dtype=I32)
    for backend in HOST_BACKENDS:
        for form in FORMS:
            k, fmt = stored(key, form)
            v, _ = stored(value, form)
            out = sparse_attn.qsa_sparse_attention(query, k, v, ids, backend=backend,
                                                   kv_cache_dtype=fmt)
            torch.testing.assert_close(out.float().flatten(), value.float().flatten(), rtol=0,
                                       atol=0, equal_nan=True)
    assert math.isnan(value.float().flatten()[0x7f]) and value.float().flatten()[0x7e] == 448


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.037, 2.5)], ids=["unit", "scaled"])
def test_paged_attention_matches_the_dequantised_oracle(backend, form, scales):
    k_scale, v_scale = scales
    hq, hkv, d, page_size = 8, 2, 64, 16
    lens_q, lens_k = [3, 1, 4], [40, 7, 64]
    table = torch.tensor([[4, 0, 2, -1], [1, -1, -1, -1], [3, 6, 9, 5]], dtype=I32)
    # K and V as engines keep them: strided views of one [pages, Hkv, page, 2 * D] cache.
    kv = fp8_randn((7, hkv, page_size, 2 * d), scale=3.0)
    key, value = kv[..., :d].permute(0, 2, 1, 3), kv[..., d:].permute(0, 2, 1, 3)
    query = randn((sum(lens_q), hq, d), BF16, "cpu")
    b_of_row = [b for b, n in enumerate(lens_q) for _ in range(n)]
    positions = torch.tensor([lens_k[b] - lens_q[b] + i for b, n in enumerate(lens_q)
                              for i in range(n)], dtype=I32)
    ids = torch.randint(-1, 64, (len(b_of_row), 40), dtype=I32)
    k, fmt = stored(key, form)
    v, _ = stored(value, form)
    out, lse = sparse_attn.qsa_sparse_attention(
        query, k, v, ids, block_table=table, page_size=page_size,
        seq_lens_k=torch.tensor(lens_k, dtype=I32), query_positions=positions,
        cu_seqlens_q=torch.tensor([0, 3, 4, 8], dtype=I32), k_scale=k_scale, v_scale=v_scale,
        kv_cache_dtype=fmt, return_lse=True, backend=backend)
    ref, ref_lse = ref_attention_rows(
        query, ids, paged_kv_of(dequantised(key, k_scale), dequantised(value, v_scale), table,
                                b_of_row),
        positions=positions.tolist(), seq_lens_k=[lens_k[b] for b in b_of_row],
        active=[True] * len(b_of_row), scale=1 / math.sqrt(d), out_dtype=BF16)
    assert out.dtype == BF16
    assert_close(out, ref, rtol=1e-2, atol=1e-2 * v_scale * 3)
    assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_physical_attention_and_both_host_backends_agree(backend):
    query = randn((5, 4, 32), BF16, "cpu")
    key, value = fp8_randn((11, 2, 32)), fp8_randn((11, 2, 32))
    ids = torch.randint(-1, 13, (5, 6), dtype=I32)
    out = sparse_attn.qsa_sparse_attention(query, key, value, selected_kv_indices=ids,
                                           k_scale=0.5, v_scale=0.25, backend=backend)
    # A power-of-two scale keeps the dequantised values exact in bfloat16: the FP8 call is the
    # bfloat16 call on them, bit for bit.
    same = sparse_attn.qsa_sparse_attention(query, (key.float() * 0.5).to(BF16),
                                            (value.float() * 0.25).to(BF16),
                                            selected_kv_indices=ids, backend=backend)
    assert torch.equal(out, same)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_indexer_ops_read_fp8_keys_unscaled(backend, form):
    h, d = 4, 128
    scale = 1 / math.sqrt(d)
    q_idx = randn((2, 9, h, d), BF16, "cpu")
    block_keys = fp8_randn((2, 3, d))
    k, fmt = stored(block_keys, form)
    scores = sparse_attn.qsa_indexer_mqa_score(q_idx, k, backend=backend, kv_cache_dtype=fmt)
    assert_close(scores, ref_indexer_padded(q_idx, block_keys.float(), scale), 2e-5, 2e-5)
    assert torch.equal(scores, sparse_attn.qsa_indexer_mqa_score(q_idx, block_keys.to(BF16),
                                                                 backend=backend))
    cache = fp8_randn((3, 8, 1, d))
    table = torch.tensor([[2, 0], [-1, 1]], dtype=I32)
    c, fmt = stored(cache, form)
    paged = sparse_attn.qsa_indexer_mqa_score(q_idx, c, block_table=table, backend=backend,
                                              kv_cache_dtype=fmt)
    assert torch.equal(paged, sparse_attn.qsa_indexer_mqa_score(
        q_idx, cache.to(BF16), block_table=table, backend=backend))

    q = randn((6, h, d), torch.float16, "cpu")
    keys = fp8_randn((7, 1, d))
    starts = torch.tensor([0, 1, 2, -3, 5, 4], dtype=I32)
    ends = torch.tensor([7, 3, 9, 2, 5, 6], dtype=I32)
    kk, fmt = stored(keys, form)
    for fn in (sparse_attn.qsa_mqa_prefill, sparse_attn.qsa_mqa):
        logits = fn(q, kk, starts, ends, backend=backend, kv_cache_dtype=fmt)
        assert_close(logits, ref_mqa_prefill(q, keys.float(), starts, ends, scale), 2e-5, 2e-5)

    q_dec = randn((2, h, d), BF16, "cpu")
    lens = torch.tensor([13, 16], dtype=I32)
    decode = sparse_attn.qsa_mqa_decode(q_dec, c, table, lens, 20, backend=backend,
                                        kv_cache_dtype=fmt)
    assert_close(decode, ref_mqa_decode(q_dec, cache.float(), table, lens, 20, scale), 2e-5,
                 2e-5)


def _attention_args():
    query = randn((1, 2, 4, 32), BF16, "cpu")
    key, value = fp8_randn((1, 8, 2, 32)), fp8_randn((1, 8, 2, 32))
    ids = torch.zeros((1, 2, 3), dtype=I32)
    return query, key, value, ids


@pytest.mark.parametrize("change,kind,match", [
    (dict(bf16=True, k_scale=2.0), ValueError,
     r"^k_scale: expected 1.0 for bfloat16 K/V \(a dequantisation scale applies to FP8"),
    (dict(bf16=True, v_scale=0.5), ValueError, r"^v_scale: expected 1.0 for bfloat16 K/V"),
    (dict(k_scale=0.0), ValueError, r"^k_scale: expected a value representable as a positive"),
    (dict(v_scale=math.nan), ValueError, r"^v_scale: expected a value representable"),
    (dict(k_scale=math.inf), ValueError, r"^k_scale: "),
    (dict(k_scale=-1.0), ValueError, r"^k_scale: "),
    (dict(k_scale="1"), TypeError, r"^k_scale: expected a float"),
    (dict(uint8=True), TypeError,
     r"^key: uint8 storage is read as FP8 e4m3 only when the format is named: pass "
     r"kv_cache_dtype='fp8_e4m3'"),
    (dict(bf16_value=True), TypeError, r"^value: expected dtype float8_e4m3fn, got bfloat16"),
    (dict(kv_cache_dtype="fp8_e5m2"), sparse_attn.NotSupportedError,
     r"^kv_cache_dtype: fp8_e5m2 caches are not supported"),
    (dict(kv_cache_dtype=torch.float8_e5m2), sparse_attn.NotSupportedError, r"^kv_cache_dtype"),
    (dict(kv_cache_dtype="float32"), ValueError, r"^kv_cache_dtype: expected float8_e4m3fn"),
    (dict(kv_cache_dtype="int8"), TypeError, r"^kv_cache_dtype: dtype int8 is not supported"),
    (dict(kv_cache_dtype=3), TypeError, r"^kv_cache_dtype: expected a dtype"),
    (dict(bf16=True, kv_cache_dtype="fp8"), TypeError,
     r"^key: kv_cache_dtype float8_e4m3fn reads uint8 or float8_e4m3fn storage, got bfloat16"),
], ids=["k_scale_with_bf16", "v_scale_with_bf16", "k_scale_zero", "v_scale_nan", "k_scale_inf",
        "k_scale_negative", "k_scale_str", "uint8_unnamed", "value_bf16", "e5m2", "e5m2_dtype",
        "float32_format", "int8_format", "int_format", "fp8_named_over_bf16"])
def test_fp8_argument_errors(change, kind, match):
    query, key, value, ids = _attention_args()
    if change.pop("bf16", False):
        key, value = key.to(BF16), value.to(BF16)
    if change.pop("uint8", False):
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    if change.pop("bf16_value", False):
        value = value.to(BF16)
    with pytest.raises(kind, match=match):
        sparse_attn.qsa_sparse_attention(query, key, value, ids, backend="reference", **change)


def test_indexer_uint8_keys_need_the_format_named():
    q = randn((3, 4, 128), BF16, "cpu")
    k = fp8_randn((5, 128)).view(torch.uint8)
    rows = torch.zeros(3, dtype=I32)
    with pytest.raises(TypeError, match=r"^k: uint8 storage .*kv_cache_dtype='fp8_e4m3'"):
        sparse_attn.qsa_mqa_prefill(q, k, rows, rows, backend="reference")
    with pytest.raises(TypeError, match=r"^block_keys: uint8 storage"):
        sparse_attn.qsa_indexer_mqa_score(q[None], k[None], backend="reference")


def test_fp8_workspace_size_on_the_host_is_zero():
    query, key, value, ids = _attention_args()
    assert sparse_attn.qsa_sparse_attention_workspace_size(
        query, key.view(torch.uint8), value.view(torch.uint8), ids, k_scale=0.5,
        kv_cache_dtype="fp8") == 0


@needs_cuda
@pytest.mark.parametrize("form", ["float8", "fp8"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", ["decode", "prefill", "decode_one_split", "prefill_one_split"])
def test_native_cuda_fp8_attention_matches_the_reference(form, dtype, shape):
    # The engine layout: K and V strided views of one [pages, page, Hkv, 2 * D] FP8 cache, page
    # 64, a gate and the LSE; decode and prefill rows with the block hint, with the heuristic's
    # SplitKV and with one split.
    dev, d, page = "cuda", 256, 64
    lens_k = [3000, 700, 1500]
    lens_q = [1, 1, 1] if shape.startswith("decode") else [40, 3, 9]
    pages = sum((n + page - 1) // page for n in lens_k) + 2
    perm = torch.randperm(pages).tolist()
    table = torch.full((3, 48), -1, dtype=I32)
    at = 0
    for b, n in enumerate(lens_k):
        for j in range((n + page - 1) // page):
            table[b, j] = perm[at]
            at += 1
    kv = fp8_randn((pages, page, 2, 2 * d), scale=40.0).to(dev)
    key, value = kv[..., :d], kv[..., d:]
    query = randn((sum(lens_q), 24, d), dtype, dev)
    gate = randn((sum(lens_q), 24, d), dtype, dev)
    positions = torch.tensor([lens_k[b] - lens_q[b] + i for b, n in enumerate(lens_q)
                              for i in range(n)], dtype=I32)
    blocks = torch.stack([torch.randint(-1, int(p) // 4 + 2, (128,), dtype=I32)
                          for p in positions])
    ids = sparse_attn.qsa_expand_blocks(blocks, positions)
    cu = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=I32)
    k, fmt = stored(key, form)
    v, _ = stored(value, form)
    args = dict(block_table=table.to(dev), page_size=page,
                seq_lens_k=torch.tensor(lens_k, dtype=I32, device=dev),
                query_positions=positions.to(dev), cu_seqlens_q=cu.to(dev),
                block_indices=blocks.to(dev), gate=gate, k_scale=0.013, v_scale=0.021,
                kv_cache_dtype=fmt, return_lse=True,
                num_splits=1 if shape.endswith("one_split") else None)
    ids = ids.to(dev)
    out, lse = sparse_attn.qsa_sparse_attention(query, k, v, ids, backend="native", **args)
    ref, ref_lse = sparse_attn.qsa_sparse_attention(query, k, v, ids, backend="reference",
                                                    **args)
    assert out.is_cuda and out.dtype == dtype
    assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert_close(lse, ref_lse, **LSE_TOL)


@needs_cuda
@pytest.mark.parametrize("form", ["float8", "fp8"])
def test_native_cuda_indexer_reads_fp8_keys_unscaled(form):
    h, d, dev = 4, 128, "cuda"
    scale = 1 / math.sqrt(d)
    q_idx = randn((2, 9, h, d), BF16, dev)
    block_keys = fp8_randn((2, 3, d)).to(dev)
    k, fmt = stored(block_keys, form)
    scores = sparse_attn.qsa_indexer_mqa_score(q_idx, k, backend="native", kv_cache_dtype=fmt)
    assert_close(scores, ref_indexer_padded(q_idx, block_keys.float(), scale), 2e-5, 2e-5)

    q = randn((6, h, d), torch.float16, dev)
    keys = fp8_randn((7, 1, d)).to(dev)
    starts = torch.tensor([0, 1, 2, -3, 5, 4], dtype=I32, device=dev)
    ends = torch.tensor([7, 3, 9, 2, 5, 6], dtype=I32, device=dev)
    kk, fmt = stored(keys, form)
    logits = sparse_attn.qsa_mqa_prefill(q, kk, starts, ends, backend="native",
                                         kv_cache_dtype=fmt)
    assert_close(logits, ref_mqa_prefill(q, keys.float(), starts, ends, scale), 2e-5, 2e-5)

    # Multi-token decode (3 rows a request) on pages of a size other than a power of two.
    q_dec = randn((2, 3, h, d), BF16, dev)
    cache = fp8_randn((3, 12, 1, d)).to(dev)
    table = torch.tensor([[2, 0], [-1, 1]], dtype=I32, device=dev)
    lens = torch.tensor([[13, 14, 24], [0, 16, 30]], dtype=I32, device=dev)
    c, fmt = stored(cache, form)
    decode = sparse_attn.qsa_mqa_decode(q_dec, c, table, lens, 26, backend="native",
                                        kv_cache_dtype=fmt)
    assert_close(decode, ref_mqa_decode(q_dec, cache.float(), table, lens, 26, scale), 2e-5,
                 2e-5)


def test_kv_cache_dtype_is_a_keyword_only_extension():
    for fn in (sparse_attn.qsa_sparse_attention, sparse_attn.qsa_indexer_mqa_score,
               sparse_attn.qsa_mqa_prefill, sparse_attn.qsa_mqa, sparse_attn.qsa_mqa_decode,
               sparse_attn.qsa_sparse_attention_workspace_size):
        p = inspect.signature(fn).parameters["kv_cache_dtype"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None


def test_compiled_fp8_attention_matches_eager():
    # Under torch.compile the call goes through the custom op, whose schema carries
    # kv_cache_dtype as a str: a torch dtype given for it travels by name.
    query, key, value, ids = _attention_args()
    k, v = key.view(torch.uint8), value.view(torch.uint8)

    def fn(query, k, v, ids):
        return sparse_attn.qsa_sparse_attention(query, k, v, ids, k_scale=0.5, v_scale=2.0,
                                                kv_cache_dtype=F8, backend="reference")

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(query, k, v, ids)
    assert torch.equal(got, fn(query, k, v, ids))
