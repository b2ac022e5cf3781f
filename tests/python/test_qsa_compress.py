"""qsa_compress_block_keys through the Python API against the float64 statements of the
model's definition (compress_testing.py), on the CPU and, where there is one, natively on the
GPU (fresh random inputs, poisoned outputs); and against transformers' own Qwen3-Next RMSNorm
and RoPE when transformers is installed."""

import math

import pytest
import torch

import sparse_attn
from compress_testing import assert_keys_close, ref_compress, rope_tables
from qsa_testing import DEVICES, needs_cuda

BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32


def nan_out(shape, dtype, device):
    return torch.full(shape, math.nan, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("rope", ["theta", "cols32", "cols64"])
def test_single_request_matches_definition(device, dtype, style, rope):
    torch.manual_seed(17)
    keys = (torch.randn(4 * 37 + 3, 128) * 2).to(dtype).to(device)  # a trailing group of 3
    w = (torch.randn(128) * 0.2).to(device)
    kw = dict(rope_style=style, eps=1e-5)
    if rope == "theta":
        kw["rope_theta"] = 1e6
    else:
        cols = 32 if rope == "cols32" else 64
        angle = torch.rand(160, cols, dtype=torch.float64) * 6.3
        kw["cos"], kw["sin"] = angle.cos().float().to(device), angle.sin().float().to(device)
    out = sparse_attn.qsa_compress_block_keys(keys, w, **kw)
    assert out.shape == (37, 128) and out.dtype == dtype and out.device == keys.device
    assert_keys_close(out, ref_compress(keys, w, **kw, out_shape=(37, 128)), dtype)
    given = nan_out((38, 128), dtype, device)
    assert sparse_attn.qsa_compress_block_keys(keys, w, **kw, out=given) is given
    assert torch.isnan(given[37].float()).all(), "the incomplete trailing group was written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 3, 16, 196])
def test_varlen_paged_with_start_positions(device, page_size):
    torch.manual_seed(page_size)
    cu = torch.tensor([0, 41, 41, 300, 306], dtype=I32)
    starts = torch.tensor([0, 7, 2, 1021], dtype=torch.int64)
    keys = torch.randn(306, 128).to(BF16)
    w = torch.randn(128).to(BF16) * 0.3
    max_blocks = (1021 + 306) // 4 + 1
    max_pages = -(-max_blocks // page_size)
    pages = 4 * max_pages + 2
    table = torch.randperm(pages)[:4 * max_pages].view(4, max_pages).to(I32)
    table[2, 0] = -1  # request 2's first page is missing: its blocks there are dropped
    kw = dict(rope_theta=1e4, cu_seqlens=cu, start_positions=starts, block_table=table,
              page_size=page_size)
    cache = nan_out((pages, page_size, 1, 128), BF16, "cpu")
    expected = ref_compress(keys, w, **kw, out_shape=tuple(cache.shape))
    dev = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    cache = cache.to(device)
    assert sparse_attn.qsa_compress_block_keys(keys.to(device), w.to(device), **dev,
                                               out=cache) is cache
    assert_keys_close(cache, expected, BF16)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_appends_only_the_completed_block(device):
    torch.manual_seed(3)
    keys = torch.randn(12, 128).to(F16).to(device)
    w = torch.zeros(128, device=device)
    table = torch.tensor([[1, 0]], dtype=I32, device=device)
    cache = nan_out((2, 2, 128), F16, device)
    sparse_attn.qsa_compress_block_keys(keys[:10], w, rope_theta=1e4, block_table=table,
                                        out=cache)
    assert torch.isnan(cache[0].float()).all()
    sparse_attn.qsa_compress_block_keys(keys[8:], w, rope_theta=1e4, block_table=table,
                                        start_positions=torch.tensor([8], device=device),
                                        out=cache)
    whole = sparse_attn.qsa_compress_block_keys(keys, w, rope_theta=1e4)
    assert torch.equal(cache[1], whole[:2]) and torch.equal(cache[0, 0], whole[2])
    assert torch.isnan(cache[0, 1].float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_padded_batch_and_strided_views(device):
    torch.manual_seed(5)
    base = torch.randn(3, 21, 2 * 128).to(BF16).to(device)
    keys = base[:, 1:, ::2]  # [3, 20, 128], strided
    w = torch.randn(128, dtype=F16, device=device) * 0.1
    out = sparse_attn.qsa_compress_block_keys(keys, w, rope_theta=5e5)
    assert out.shape == (3, 5, 128)
    assert_keys_close(out, ref_compress(keys, w, rope_theta=5e5, out_shape=(3, 5, 128)), BF16)


def test_layouts_that_need_out():
    keys, w = torch.randn(8, 128).to(BF16), torch.zeros(128)
    with pytest.raises(ValueError, match="^out: "):
        sparse_attn.qsa_compress_block_keys(keys, w, rope_theta=1e4,
                                            cu_seqlens=torch.tensor([0, 8], dtype=I32))
    # The other arguments are checked first.
    with pytest.raises(ValueError, match="^rope_dim: "):
        sparse_attn.qsa_compress_block_keys(keys, w, rope_theta=1e4, rope_dim=3,
                                            start_positions=torch.tensor([0]))


@pytest.mark.parametrize("change,error,name", [
    (dict(keys=torch.randn(8, 128)), TypeError, "keys"),
    (dict(weight=torch.zeros(64)), ValueError, "weight"),
    (dict(rope_theta=None), ValueError, "rope_theta"),
    (dict(cos=torch.ones(8, 32)), ValueError, "sin"),
    (dict(rope_style="neox"), ValueError, "rope_style"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(eps="1e-6"), TypeError, "eps"),
    (dict(out=torch.empty(2, 128, dtype=F16)), TypeError, "out"),
    (dict(backend="cuda"), ValueError, "backend"),
], ids=["keys_fp32", "weight_shape", "no_rope", "cos_without_sin", "rope_style", "eps_negative",
        "eps_kind", "out_dtype", "backend"])
def test_malformed_calls_name_the_argument(change, error, name):
    kw = dict(keys=torch.randn(8, 128).to(BF16), weight=torch.zeros(128), rope_theta=1e4)
    kw.update(change)
    with pytest.raises(error, match=f"^{name}: "):
        sparse_attn.qsa_compress_block_keys(**kw)


@needs_cuda
@pytest.mark.skipif(not sparse_attn.built_with_cuda, reason="built without CUDA")
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_native_matches_reference_on_fresh_inputs(dtype):
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        n = int(torch.randint(1, 5000, (1,), generator=g))
        keys = (torch.randn(n, 128, generator=g) * 3).to(dtype).cuda()
        w = (torch.randn(128, generator=g) * 0.3).cuda()
        kw = dict(rope_theta=1e7, start_positions=torch.tensor([seed], device="cuda"))
        nb = (n + seed) // 4 + 1
        native = nan_out((nb, 128), dtype, "cuda")
        ref = nan_out((nb, 128), dtype, "cuda")
        sparse_attn.qsa_compress_block_keys(keys, w, **kw, out=native)
        sparse_attn.qsa_compress_block_keys(keys, w, **kw, out=ref, backend="reference")
        assert_keys_close(native, ref.double(), dtype, both_rounded=True)


def test_matches_transformers_qwen3_next_rmsnorm_and_rope():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    torch.manual_seed(11)
    keys = torch.randn(64, 128).to(BF16)
    w = torch.randn(128) * 0.2
    norm = modeling.Qwen3NextRMSNorm(128, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    cos, sin = rope_tables(1e7, 64, 64)
    positions = torch.arange(0, 64, 4)
    # transformers' steps in FP32: the group mean, its (1 + w) RMSNorm, partial rotate_half RoPE.
    mean = keys.float().view(16, 4, 128).mean(1)
    normed = norm(mean)
    q = normed[None, None]  # [batch, heads, blocks, dim]
    rotated, _ = modeling.apply_rotary_pos_emb(q, q, cos[positions][None], sin[positions][None])
    expected = rotated[0, 0].double()
    got = sparse_attn.qsa_compress_block_keys(keys, w, cos=cos, sin=sin)
    assert_keys_close(got, expected, BF16)
