"""The scratch memory of qsa_sparse_attention as an argument (destination passing):
qsa_sparse_attention_workspace_size, the workspace= keyword and its validation. By default
the wrapper allocates the scratch with torch when the call needs it; tests of that path under
streams, CUDA graphs and torch.compile are in test_torch_integration.py."""

import pytest
import torch

import sparse_attn
from qsa_testing import assert_close, call_native_or_skip, needs_cuda, randn


def small_call(device="cpu"):
    """A reference-sized call: padded query [1, 2, 4, 32], padded K/V [1, 8, 2, 32]."""
    query = randn((1, 2, 4, 32), torch.bfloat16, device)
    key = randn((1, 8, 2, 32), torch.bfloat16, device)
    value = randn((1, 8, 2, 32), torch.bfloat16, device)
    ids = torch.randint(-1, 8, (1, 2, 5), dtype=torch.int32, device=device)
    return (query, key, value, ids)


def decode_call(device, batch=2, token_to_req=False):
    """A decode step in the canonical geometry (24/2/256, paged K/V in pages of 64) with 33793
    selected ids per row, past the 16 splits of 2112 the gather kernel takes (its SplitKV
    merges in a cluster, without workspace): the per-row kernel's SplitKV partials with the
    default split heuristic; token_to_req (int64, with the positions it needs) adds nothing to
    them."""
    page, pages_per_req, width = 64, 64, 16 * 2112 + 1  # capacity 4096 tokens per request
    lens = [2500 + 577 * b for b in range(batch)]
    query = randn((batch, 24, 256), torch.bfloat16, device)
    key = randn((batch * pages_per_req, page, 2, 256), torch.bfloat16, device)
    value = randn((batch * pages_per_req, page, 2, 256), torch.bfloat16, device)
    table = torch.randperm(batch * pages_per_req, device="cpu").to(torch.int32)
    table = table.view(batch, pages_per_req).to(device)
    ids = torch.stack([torch.randint(-1, n, (width,), dtype=torch.int32) for n in lens])
    kwargs = dict(block_table=table, seq_lens_k=torch.tensor(lens, dtype=torch.int32,
                                                                device=device))
    if token_to_req:
        kwargs.update(token_to_req=torch.arange(batch, dtype=torch.int64, device=device),
                      query_positions=torch.tensor(lens, dtype=torch.int64, device=device) - 1)
    else:
        kwargs.update(cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device))
    return (query, key, value, ids.to(device)), kwargs


# ------------------------------------------------------------------------------------------
# The size: 0 wherever the call needs no scratch; the call's errors for bad inputs
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "native"])
def test_size_is_zero_for_host_tensors(backend):
    assert sparse_attn.qsa_sparse_attention_workspace_size(*small_call(),
                                                           backend=backend) == 0


def test_size_takes_every_keyword_of_the_call():
    query, key, value, ids = small_call()
    kwargs = dict(seq_lens_k=torch.tensor([8], dtype=torch.int32), scale=0.3, num_splits=2,
                  return_lse=True, out=torch.empty_like(query), lse=None,
                  workspace=torch.empty(7, dtype=torch.uint8), backend="reference")
    assert sparse_attn.qsa_sparse_attention_workspace_size(query, key, value, ids,
                                                           **kwargs) == 0
    sparse_attn.qsa_sparse_attention(query, key, value, ids, **kwargs)


@pytest.mark.parametrize("kwargs,kind,name", [
    (dict(scale=0.1, softmax_scale=0.1), ValueError, "softmax_scale"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(seq_lens_k=torch.zeros(1, dtype=torch.float32)), TypeError, "seq_lens_k"),
], ids=["scale_and_softmax_scale", "num_splits_zero", "seq_lens_k_float32"])
def test_size_raises_the_calls_errors(kwargs, kind, name):
    with pytest.raises(kind, match=name):
        sparse_attn.qsa_sparse_attention_workspace_size(*small_call(), backend="reference",
                                                        **kwargs)


def test_size_of_a_query_of_the_wrong_rank():
    query, key, value, ids = small_call()
    with pytest.raises(ValueError, match="query"):
        sparse_attn.qsa_sparse_attention_workspace_size(query[0, 0], key, value, ids,
                                                        backend="reference")


# ------------------------------------------------------------------------------------------
# workspace=: accepted where valid, refused naming it otherwise
# ------------------------------------------------------------------------------------------

def test_an_allocator_is_not_called_when_no_scratch_is_needed():
    def fail(nbytes):
        raise AssertionError("called")

    args = small_call()
    sparse_attn.qsa_sparse_attention(*args, backend="reference", workspace=fail)


def test_a_workspace_leaves_the_result_unchanged():
    args = small_call()
    expected = sparse_attn.qsa_sparse_attention(*args, backend="reference")
    workspace = torch.full((64,), 255, dtype=torch.uint8)
    got = sparse_attn.qsa_sparse_attention(*args, backend="reference", workspace=workspace)
    assert torch.equal(got, expected)


def _bad_workspaces():
    buf = torch.zeros(256, dtype=torch.uint8)
    return [
        pytest.param(lambda args: torch.zeros(16, dtype=torch.float32), TypeError, id="float32"),
        pytest.param(lambda args: torch.zeros((4, 16), dtype=torch.uint8), ValueError, id="2d"),
        pytest.param(lambda args: buf[::2], ValueError, id="strided"),
        pytest.param(lambda args: buf[8:], ValueError, id="not_16_byte_aligned"),
        pytest.param(lambda args: args[0].view(torch.uint8).flatten(), ValueError,
                     id="overlaps_query"),
        pytest.param(lambda args: 64, TypeError, id="int"),
        pytest.param(lambda args: [0] * 64, TypeError, id="list"),
    ]


@pytest.mark.parametrize("make,kind", _bad_workspaces())
def test_bad_workspaces_are_refused_naming_it(make, kind):
    args = small_call()
    with pytest.raises(kind, match="^workspace: "):
        sparse_attn.qsa_sparse_attention(*args, backend="reference", workspace=make(args))


def test_workspace_overlapping_out_is_refused():
    args = small_call()
    out = torch.empty_like(args[0])
    with pytest.raises(ValueError, match="^workspace: .*out"):
        sparse_attn.qsa_sparse_attention(*args, backend="reference", out=out,
                                         workspace=out.view(torch.uint8).flatten())


# ------------------------------------------------------------------------------------------
# CUDA: the native call with a caller-owned workspace
# ------------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("token_to_req", [False, True], ids=["cu_seqlens", "token_to_req"])
def test_native_with_a_poisoned_workspace_matches(token_to_req):
    args, kwargs = decode_call("cuda", token_to_req=token_to_req)
    size = call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention_workspace_size(
        *args, backend="native", **kwargs), "native")
    # Two requests, two KV heads: 4 CTAs without splits on a GPU of 100+ SMs, so the
    # heuristic splits (partials in the workspace).
    assert size > 0
    workspace = torch.full((size,), 255, dtype=torch.uint8, device="cuda")
    out, lse = sparse_attn.qsa_sparse_attention(*args, backend="native", workspace=workspace,
                                                return_lse=True, **kwargs)
    # The same schedule with the scratch from torch's allocator: bitwise the same.
    again, again_lse = sparse_attn.qsa_sparse_attention(*args, backend="native",
                                                        return_lse=True, **kwargs)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)
    ref, ref_lse = sparse_attn.qsa_sparse_attention(*args, backend="reference",
                                                    return_lse=True, **kwargs)
    assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert_close(lse, ref_lse, rtol=2e-3, atol=2e-3)


@needs_cuda
def test_native_refuses_a_workspace_one_byte_short():
    args, kwargs = decode_call("cuda")
    size = call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention_workspace_size(
        *args, backend="native", **kwargs), "native")
    short = torch.empty(size - 1, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=f"^workspace: expected at least {size} bytes"):
        sparse_attn.qsa_sparse_attention(*args, backend="native", workspace=short, **kwargs)


@needs_cuda
def test_an_allocator_is_asked_once_for_the_size():
    args, kwargs = decode_call("cuda")
    size = call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention_workspace_size(
        *args, backend="native", **kwargs), "native")
    asked = []

    def allocate(nbytes):
        asked.append(nbytes)
        return torch.full((nbytes,), 255, dtype=torch.uint8, device="cuda")

    out = sparse_attn.qsa_sparse_attention(*args, backend="native", workspace=allocate,
                                           **kwargs)
    assert asked == [size]
    assert torch.equal(out, sparse_attn.qsa_sparse_attention(*args, backend="native", **kwargs))
    asked.clear()
    sparse_attn.qsa_sparse_attention(*args, backend="native", workspace=allocate, num_splits=1,
                                     **kwargs)
    assert asked == []


@needs_cuda
def test_an_allocators_error_propagates():
    args, kwargs = decode_call("cuda")
    call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention(*args, backend="native",
                                                                 **kwargs), "native")

    def fail(nbytes):
        raise MemoryError(f"no {nbytes} bytes today")

    with pytest.raises(MemoryError, match="no [0-9]+ bytes today"):
        sparse_attn.qsa_sparse_attention(*args, backend="native", workspace=fail, **kwargs)
    with pytest.raises(TypeError, match="^workspace: "):
        sparse_attn.qsa_sparse_attention(*args, backend="native", workspace=lambda n: n,
                                         **kwargs)


@needs_cuda
def test_native_refuses_a_workspace_on_the_host():
    args, kwargs = decode_call("cuda")
    call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention(*args, backend="native",
                                                                 **kwargs), "native")
    with pytest.raises(ValueError, match="^workspace: "):
        sparse_attn.qsa_sparse_attention(*args, backend="native", **kwargs,
                                         workspace=torch.empty(1 << 20, dtype=torch.uint8))


@needs_cuda
def test_size_depends_on_shapes_not_contents():
    args, kwargs = decode_call("cuda", batch=3)
    size = call_native_or_skip(lambda: sparse_attn.qsa_sparse_attention_workspace_size(
        *args, backend="native", **kwargs), "native")
    args[3].fill_(-1)
    kwargs["seq_lens_k"].fill_(1)
    assert sparse_attn.qsa_sparse_attention_workspace_size(*args, backend="native",
                                                           **kwargs) == size
    assert sparse_attn.qsa_sparse_attention_workspace_size(*args, backend="native",
                                                           num_splits=1, **kwargs) == 0
