"""Malformed calls across every public function: tensors whose torch flags DLPack drops (the
negative bit, meta tensors), scales outside float32, strided metadata, integers that size an
output, and huge broadcast inputs next to a malformed argument. Each must give the error of
the malformation, naming the argument, or the right result."""

import math

import numpy as np
import pytest
import torch

import sparse_attn
from sparse_attn import _C

BF = torch.bfloat16
I32 = torch.int32


def zeros(*shape, dtype=BF):
    return torch.zeros(shape, dtype=dtype)


def ints(*values):
    return torch.tensor(values, dtype=I32)


def rand(*shape, dtype=BF):
    return torch.randn(shape, dtype=torch.float64).to(dtype)


# One valid, small call per public function (reference backend, CPU): (fn, args, kwargs).
# Tensor arguments are found by position or keyword and replaced one at a time below.
def valid_calls():
    cu = ints(0, 130, 200)
    calls = {
        "qsa_indexer_mqa_score": (sparse_attn.qsa_indexer_mqa_score,
                                  (rand(1, 5, 4, 128), rand(1, 3, 128)), {}),
        "qsa_mqa_prefill": (sparse_attn.qsa_mqa_prefill,
                            (rand(2, 4, 128), rand(3, 128), ints(0, 0), ints(3, 2)), {}),
        "qsa_mqa_decode": (sparse_attn.qsa_mqa_decode,
                           (rand(2, 4, 128), rand(4, 16, 128), ints(0, 1, 2, 3).view(2, 2),
                            ints(20, 5), 32), {}),
        "qsa_sparse_attention": (sparse_attn.qsa_sparse_attention,
                                 (rand(2, 1, 4, 32), rand(2, 8, 2, 32), rand(2, 8, 2, 32),
                                  torch.randint(-1, 8, (2, 1, 5), dtype=I32)),
                                 {"return_lse": True}),
        "qsa_indexer_select": (sparse_attn.qsa_indexer_select,
                               (rand(1, 5, 4, 128), rand(1, 3, 128), 2),
                               {"return_tokens": True, "return_valid_counts": True}),
        "qsa_mqa_decode_select": (sparse_attn.qsa_mqa_decode_select,
                                  (rand(2, 4, 128), rand(4, 16, 128), ints(0, 1, 2, 3).view(2, 2),
                                   ints(20, 5), 32, 2),
                                  {"query_positions": ints(79, 19), "return_tokens": True}),
        "qsa_compress_block_keys": (sparse_attn.qsa_compress_block_keys,
                                    (rand(8, 128), rand(128)), {"rope_theta": 10000.0}),
        "merge_attention_states": (sparse_attn.merge_attention_states,
                                   (rand(2, 3, 2, 16), torch.randn(2, 3, 2)), {}),
        "qsa_topk_blocks": (sparse_attn.qsa_topk_blocks, (torch.randn(3, 20), 4), {}),
        "qsa_expand_blocks": (sparse_attn.qsa_expand_blocks,
                              (torch.randint(-1, 5, (3, 4), dtype=I32), ints(3, 17, 25)),
                              {"return_block_indices": True}),
        "xattn_estimate": (sparse_attn.xattn_estimate,
                           (rand(1, 2, 256, 32, dtype=torch.float32),
                            rand(1, 2, 256, 32, dtype=torch.float32), 128, 8), {}),
        "find_blocks_chunked": (sparse_attn.find_blocks_chunked,
                                (torch.rand(1, 2, 2, 2), 0, 0.9, None, False), {}),
        "block_sparse_attn_func": (sparse_attn.block_sparse_attn_func,
                                   (rand(200, 2, 32), rand(200, 2, 32), rand(200, 2, 32), cu, cu,
                                    None, None, torch.ones((2, 2, 2, 2), dtype=torch.bool), 130,
                                    130, 0.0), {}),
        "block_sparse_attn_paged_func": (sparse_attn.block_sparse_attn_paged_func,
                                         (rand(200, 2, 32), rand(4, 128, 2, 32),
                                          rand(4, 128, 2, 32), ints(0, 1, 2, 3).view(2, 2),
                                          ints(130, 70), cu,
                                          torch.ones((2, 2, 2, 2), dtype=torch.bool), 130, 130),
                                         {}),
        "Xattention_prefill": (sparse_attn.Xattention_prefill,
                               (rand(1, 2, 256, 32, dtype=torch.float32),
                                rand(1, 2, 256, 32, dtype=torch.float32),
                                rand(1, 2, 256, 32, dtype=torch.float32), 8), {}),
        "xattention_prefill_paged": (sparse_attn.xattention_prefill_paged,
                                     (rand(1, 2, 128, 32), rand(2, 128, 2, 32),
                                      rand(2, 128, 2, 32), ints(0, 1).view(1, 2), 256, 8), {}),
    }
    # The workspace sizes take their op's arguments and validate them alike.
    for op in ("qsa_indexer_select", "qsa_mqa_decode_select", "qsa_sparse_attention"):
        _, args, kwargs = calls[op]
        calls[f"{op}_workspace_size"] = (getattr(sparse_attn, f"{op}_workspace_size"), args,
                                         kwargs)
    return calls


# The binding's names of the positional tensor arguments (the seed's parameter names).
ARG_NAMES = {
    "qsa_indexer_mqa_score": ["q_idx", "block_keys"],
    "qsa_mqa_prefill": ["q", "k", "row_starts", "row_ends"],
    "qsa_mqa_decode": ["q", "k_cache", "page_table", "context_lens"],
    "qsa_sparse_attention": ["query", "key", "value", "token_indices"],
    "qsa_indexer_select": ["q_idx", "block_keys"],
    "qsa_mqa_decode_select": ["q", "k_cache", "page_table", "context_lens"],
    "qsa_compress_block_keys": ["keys", "weight"],
    "qsa_indexer_select_workspace_size": ["q_idx", "block_keys"],
    "qsa_mqa_decode_select_workspace_size": ["q", "k_cache", "page_table", "context_lens"],
    "qsa_sparse_attention_workspace_size": ["query", "key", "value", "token_indices"],
    "merge_attention_states": ["partial_out", "partial_lse"],
    "qsa_topk_blocks": ["scores"],
    "qsa_expand_blocks": ["block_ids", "query_positions"],
    "xattn_estimate": ["query_states", "key_states"],
    "find_blocks_chunked": ["input_tensor"],
    "block_sparse_attn_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", None, None,
                               "base_blockmask"],
    "block_sparse_attn_paged_func": ["q", "k_cache", "v_cache", "block_table", "seqlens_k",
                                     "cu_seqlens_q", "base_blockmask"],
    "Xattention_prefill": ["query_states", "key_states", "value_states"],
    "xattention_prefill_paged": ["query_states", "k_cache", "v_cache", "block_table"],
}


# The selection helpers take no backend (host tensors run on the CPU).
NO_BACKEND = {"qsa_topk_blocks", "qsa_expand_blocks"}


def run(name, args, kwargs):
    fn = valid_calls()[name][0]
    return fn(*args, **kwargs, **({} if name in NO_BACKEND else {"backend": "reference"}))


def tensor_slots():
    return [pytest.param(name, i, arg, id=f"{name}-{arg}") for name, names in ARG_NAMES.items()
            for i, arg in enumerate(names) if arg is not None]


def with_arg(name, i, value):
    _, args, kwargs = valid_calls()[name]
    args = list(args)
    args[i] = value(args[i])
    return args, kwargs


def test_every_valid_call_runs():
    for name, (_, args, kwargs) in valid_calls().items():
        run(name, args, kwargs)


# ----------------------------------------------------------------------------------------
# torch's negative bit and meta tensors
# ----------------------------------------------------------------------------------------

def test_dlpack_does_not_carry_the_negative_bit():
    # Why the binding checks the bit itself: every export hands out the stored values.
    x = torch.arange(3.0)
    assert torch.equal(torch.from_dlpack(x._neg_view()), x)


@pytest.mark.parametrize("name,i,arg", tensor_slots())
def test_negative_bit_inputs_are_type_errors(name, i, arg):
    args, kwargs = with_arg(name, i, lambda t: t._neg_view())
    with pytest.raises(TypeError, match=rf"^{arg}: the tensor has torch's negative bit set"):
        run(name, args, kwargs)


def test_imaginary_part_of_a_conjugate_view_is_refused():
    q, k = rand(2, 4, 128, dtype=torch.float32), rand(3, 128, dtype=torch.float32)
    kc = torch.complex(k, k).conj().imag.to(BF)  # .to() resolves: a plain tensor
    sparse_attn.qsa_mqa_prefill(q.to(BF), kc, ints(0, 0), ints(3, 3), backend="reference")
    imag = torch.complex(k, k).conj().imag
    assert imag.is_neg()
    with pytest.raises(TypeError, match="^k: the tensor has torch's negative bit set"):
        sparse_attn.qsa_mqa_prefill(q, imag, ints(0, 0), ints(3, 3), backend="reference")


def test_resolved_negative_views_give_the_negated_result():
    q, k = rand(2, 4, 128), rand(3, 128)
    starts, ends = ints(0, 0), ints(3, 3)
    resolved = sparse_attn.qsa_mqa_prefill(q, k._neg_view().resolve_neg(), starts, ends,
                                           backend="reference")
    expected = sparse_attn.qsa_mqa_prefill(q, -k, starts, ends, backend="reference")
    assert torch.equal(resolved, expected)


def test_negative_bit_outputs_are_type_errors():
    q, k = rand(2, 4, 128), rand(3, 128)
    with pytest.raises(TypeError, match=r"^out: the tensor has torch's negative bit set.*"
                                        "an output cannot be written through it"):
        sparse_attn.qsa_mqa_prefill(q, k, ints(0, 0), ints(3, 3), backend="reference",
                                    out=torch.empty(2, 3)._neg_view())


def test_negative_bit_lse_and_workspace_are_refused():
    _, args, kwargs = valid_calls()["qsa_sparse_attention"]
    lse = torch.empty(2, 1, 4)._neg_view()
    with pytest.raises(TypeError, match="^lse: the tensor has torch's negative bit set"):
        sparse_attn.qsa_sparse_attention(*args, lse=lse, **kwargs, backend="reference")
    workspace = torch.zeros(64, dtype=torch.uint8)._neg_view()
    with pytest.raises(TypeError, match="^workspace: the tensor has torch's negative bit set"):
        sparse_attn.qsa_sparse_attention(*args, workspace=workspace, **kwargs,
                                         backend="reference")


@pytest.mark.parametrize("name,i,arg", tensor_slots())
def test_meta_tensors_are_clean_type_errors(name, i, arg):
    args, kwargs = with_arg(name, i, lambda t: t.to("meta"))
    with pytest.raises(TypeError) as info:
        run(name, args, kwargs)
    message = str(info.value)
    # The allocation like a meta first argument may succeed (torch allocates meta outputs);
    # whichever argument the binding reaches first is named, without a Python traceback.
    assert "meta tensors are not supported" in message, message
    assert "Traceback" not in message and "\n" not in message


def test_meta_tensor_error_names_the_argument():
    with pytest.raises(TypeError, match="^k: meta tensors are not supported"):
        sparse_attn.qsa_mqa_prefill(rand(2, 4, 128), torch.empty(3, 128, dtype=BF, device="meta"),
                                    ints(0, 0), ints(3, 3), backend="reference")


# ----------------------------------------------------------------------------------------
# Scales: one rule (positive and finite in float32) for every scale-like argument
# ----------------------------------------------------------------------------------------

SCALE_CALLS = {
    "indexer_scale": ("qsa_indexer_mqa_score", "scale"),
    "indexer_score_scale": ("qsa_indexer_mqa_score", "score_scale"),
    "prefill_scale": ("qsa_mqa_prefill", "scale"),
    "prefill_score_scale": ("qsa_mqa_prefill", "score_scale"),
    "decode_scale": ("qsa_mqa_decode", "scale"),
    "decode_score_scale": ("qsa_mqa_decode", "score_scale"),
    "indexer_select_scale": ("qsa_indexer_select", "scale"),
    "indexer_select_score_scale": ("qsa_indexer_select", "score_scale"),
    "decode_select_scale": ("qsa_mqa_decode_select", "scale"),
    "decode_select_score_scale": ("qsa_mqa_decode_select", "score_scale"),
    "attention_scale": ("qsa_sparse_attention", "scale"),
    "attention_softmax_scale": ("qsa_sparse_attention", "softmax_scale"),
    "estimate_norm": ("xattn_estimate", "norm"),
    "bsa_softmax_scale": ("block_sparse_attn_func", "softmax_scale"),
    "paged_softmax_scale": ("block_sparse_attn_paged_func", "softmax_scale"),
    "prefill_xattn_norm": ("Xattention_prefill", "norm"),
    "prefill_xattn_softmax_scale": ("Xattention_prefill", "softmax_scale"),
    "paged_xattn_norm": ("xattention_prefill_paged", "norm"),
    "paged_xattn_softmax_scale": ("xattention_prefill_paged", "softmax_scale"),
}


@pytest.mark.parametrize("value", [1e39, 1e-46, math.inf, math.nan, 0.0, -1.0, 10**400],
                         ids=["1e39", "1e-46", "inf", "nan", "zero", "negative", "int10e400"])
@pytest.mark.parametrize("case", list(SCALE_CALLS))
def test_scales_outside_float32_are_value_errors(case, value):
    name, keyword = SCALE_CALLS[case]
    _, args, kwargs = valid_calls()[name]
    with pytest.raises(ValueError, match=rf"^{keyword}: "):
        run(name, args, {**kwargs, keyword: value})


def test_score_scale_whose_reciprocal_overflows_float32():
    _, args, _ = valid_calls()["qsa_mqa_prefill"]
    with pytest.raises(ValueError, match=r"^score_scale: expected 1 / score_scale to be"):
        sparse_attn.qsa_mqa_prefill(*args, score_scale=1e-40, backend="reference")


def test_largest_float32_scales_still_work():
    _, args, _ = valid_calls()["qsa_mqa_prefill"]
    out = sparse_attn.qsa_mqa_prefill(*args, scale=1e-30, backend="reference")
    assert torch.isfinite(out[0, :3]).all()


# ----------------------------------------------------------------------------------------
# Strided cu_seqlens in the XAttention attention ops
# ----------------------------------------------------------------------------------------

def every_other(cu):
    # cu as a stride-2 view whose skipped elements are wrong offsets.
    buf = torch.full((2 * cu.numel(),), 999, dtype=I32)
    buf[::2] = cu
    view = buf[::2]
    assert view.stride() == (2,)
    return view


def test_block_sparse_attn_func_honours_cu_seqlens_strides():
    _, args, _ = valid_calls()["block_sparse_attn_func"]
    q, k, v, cu_q, cu_k = args[:5]
    expected = sparse_attn.block_sparse_attn_func(*args, backend="reference")
    for strided in ((every_other(cu_q), cu_k), (cu_q, every_other(cu_k)),
                    (every_other(cu_q), every_other(cu_k))):
        out = torch.full_like(q, float("nan"))
        sparse_attn.block_sparse_attn_func(q, k, v, *strided, *args[5:], backend="reference",
                                           out=out)
        assert torch.equal(out, expected)


def test_paged_form_honours_cu_seqlens_q_stride():
    _, args, _ = valid_calls()["block_sparse_attn_paged_func"]
    expected = sparse_attn.block_sparse_attn_paged_func(*args, backend="reference")
    strided = list(args)
    strided[5] = every_other(args[5])
    out = torch.full_like(args[0], float("nan"))
    sparse_attn.block_sparse_attn_paged_func(*strided, backend="reference", out=out)
    assert torch.equal(out, expected)


# ----------------------------------------------------------------------------------------
# Integers that size an output are checked before the allocation
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [-1, 0, 2**31, 2**62, 2**63], ids=["neg", "zero", "2e31", "2e62",
                                                                 "2e63"])
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_topk_k_is_a_value_error_naming_it(k, framework):
    scores = torch.randn(3, 20)
    with pytest.raises(ValueError, match="^k: "):
        sparse_attn.qsa_topk_blocks(scores if framework == "torch" else scores.numpy(), k)


def test_topk_k_beyond_the_blocks_still_pads():
    out = sparse_attn.qsa_topk_blocks(torch.randn(2, 3), 5)
    assert out.shape == (2, 5) and (out[:, 3:] == -1).all()


# ----------------------------------------------------------------------------------------
# Huge broadcast inputs with a malformation elsewhere
# ----------------------------------------------------------------------------------------

HUGE = 2**40


def broadcast(t, axis):
    # A view of t with axis `axis` grown to HUGE rows of one element (no memory behind it).
    shape = list(t.shape)
    shape[axis] = HUGE
    return t.narrow(axis, 0, 1).expand(shape)


# (function, index of the huge argument, its axis, index of the malformed argument, how it is
# malformed, the name the error must give).
HUGE_CASES = [
    ("qsa_mqa_prefill", 0, 0, 1, lambda t: t.float(), "k"),
    ("qsa_mqa_prefill", 1, 0, 0, lambda t: t.float(), "q"),
    ("qsa_mqa_decode", 0, 0, 1, lambda t: t.float(), "k_cache"),
    ("qsa_indexer_mqa_score", 0, 1, 1, lambda t: t.float(), "block_keys"),
    ("qsa_indexer_mqa_score", 1, 1, 0, lambda t: t.float(), "q_idx"),
    ("qsa_sparse_attention", 0, 0, 1, lambda t: t.float(), "key"),
    ("qsa_sparse_attention", 0, 2, 1, lambda t: t.float(), "key"),
    ("qsa_indexer_select", 0, 1, 1, lambda t: t.float(), "block_keys"),
    ("qsa_indexer_select", 1, 1, 0, lambda t: t.float(), "q_idx"),
    ("qsa_mqa_decode_select", 0, 0, 1, lambda t: t.float(), "k_cache"),
    ("qsa_compress_block_keys", 0, 0, 1, lambda t: t.long(), "weight"),
    ("merge_attention_states", 0, 1, 1, lambda t: t.long(), "partial_lse"),
    ("qsa_topk_blocks", 0, 0, 0, lambda t: t.half(), "scores"),
    ("qsa_expand_blocks", 0, 0, 1, lambda t: t.long(), "query_positions"),
    # The XAttention bindings name the Python parameters (key_states, input_tensor), not the
    # C++ arguments (key, attn_sums).
    ("xattn_estimate", 0, 1, 1, lambda t: t.half(), "key_states"),
    ("xattn_estimate", 0, 2, 1, lambda t: t.half(), "key_states"),
    ("find_blocks_chunked", 0, 1, 0, lambda t: t.half(), "input_tensor"),
    ("block_sparse_attn_func", 0, 0, 1, lambda t: t.float(), "k"),
    ("block_sparse_attn_func", 0, 1, 1, lambda t: t.float(), "k"),
    ("block_sparse_attn_paged_func", 0, 1, 2, lambda t: t.float(), "v_cache"),
    ("Xattention_prefill", 0, 1, 1, lambda t: t.half(), "key_states"),
    ("xattention_prefill_paged", 0, 1, 2, lambda t: t.float(), "v_cache"),
]


@pytest.mark.parametrize("name,huge,axis,bad,malform,error_name", HUGE_CASES,
                         ids=[f"{c[0]}-arg{c[1]}_axis{c[2]}-bad{c[3]}" for c in HUGE_CASES])
def test_huge_broadcast_input_gives_the_malformation_error(name, huge, axis, bad, malform,
                                                           error_name):
    _, args, kwargs = valid_calls()[name]
    args = list(args)
    args[bad] = malform(args[bad])
    args[huge] = broadcast(args[huge], axis)
    with pytest.raises((ValueError, TypeError), match=rf"^{error_name}: "):
        run(name, args, kwargs)


def test_huge_broadcast_numpy_input_gives_the_malformation_error():
    q = np.broadcast_to(np.zeros((1, 4, 128), np.float16), (HUGE, 4, 128))
    with pytest.raises(TypeError, match="^k: "):
        sparse_attn.qsa_mqa_prefill(q, np.zeros((3, 128), np.float32), np.zeros(2, np.int32),
                                    np.zeros(2, np.int32), backend="reference")


def test_huge_broadcast_heads_with_given_out_are_value_errors_not_memory_errors():
    # With out= given the C++ side sees the huge head count; per-head tables are built only
    # after every argument (the outputs included) is checked.
    cu = ints(0, 256)
    q = zeros(1, 1, 32).expand(256, HUGE, 32)
    kv = zeros(256, 2, 32)
    with pytest.raises(ValueError, match="^base_blockmask: required"):
        sparse_attn.block_sparse_attn_func(q, kv, kv, cu, cu, None, None, None, 256, 256, 0.0,
                                           out=q, backend="reference")
    sums = zeros(1, 1, 1, 1, dtype=torch.float32).expand(1, HUGE, 2, 2)
    mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool).expand(1, HUGE, 2, 2)
    # find_blocks_chunked's output is its parameter out (the C++ block_mask).
    with pytest.raises(ValueError, match="^out: expected positive strides"):
        sparse_attn.find_blocks_chunked(sums, 0, 0.9, None, False, out=mask, backend="reference")


def test_huge_broadcast_input_with_a_malformed_given_output_names_that_output():
    # The wrapper allocates only the outputs not given; when that fails, a given output that is
    # itself malformed must still be the error (the binding checks it before reporting the
    # placeholder of the missing one).
    cu = ints(0, 0)
    q = zeros(1, 1, 8).expand(HUGE, 1, 8)
    kv = zeros(0, 1, 8)
    with pytest.raises(ValueError, match="^lse: expected shape"):
        sparse_attn.block_sparse_attn_func(q, kv, kv, cu, cu, None, None, zeros(
            1, 1, 0, 0, dtype=torch.bool), 0, 0, 0.0, backend="reference", lse=zeros(
                0, 1, dtype=torch.float32))
    query = zeros(1, 1, 1, 8).expand(1, HUGE, 1, 8)
    key = zeros(1, 1, 1, 8)
    with pytest.raises(ValueError, match="^out: expected shape"):
        sparse_attn.Xattention_prefill(query, key, key, 4, threshold=0.0, causal=False,
                                       backend="reference", out=zeros(1, 1, 1, 8))
    block_ids = torch.zeros((1, 2), dtype=I32).expand(HUGE, 2)
    positions = torch.zeros((1,), dtype=I32).expand(HUGE)
    with pytest.raises(ValueError, match="^block_indices: expected shape"):
        sparse_attn.qsa_expand_blocks(block_ids, positions, return_block_indices=True,
                                      block_indices=torch.zeros(3, dtype=I32))
    with pytest.raises(ValueError, match="^token_indices: expected shape"):
        sparse_attn.qsa_expand_blocks(block_ids, positions, return_block_indices=True,
                                      token_indices=torch.zeros(3, dtype=I32))


def test_missing_output_placeholder_is_reported_after_every_other_argument():
    # _C.MISSING_OUTPUT (what explain_allocation_failure passes) is named only once the rest
    # of the call passed; a malformed input is still its own error.
    scores = torch.rand(3, 20)
    with pytest.raises(ValueError, match="^out: missing output"):
        _C.qsa_topk_blocks(scores, 2, _C.MISSING_OUTPUT, None)
    with pytest.raises(TypeError, match="^scores: "):
        _C.qsa_topk_blocks(scores.half(), 2, _C.MISSING_OUTPUT, None)
    with pytest.raises(TypeError, match="^scores: "):
        _C.qsa_topk_blocks(_C.MISSING_OUTPUT, 2, torch.zeros(3, 2, dtype=I32), None)


def test_huge_varlen_indexer_rows_are_refused_by_name():
    # int32 cu_seqlens_q offsets cannot end at 2**40 rows: a ValueError before any allocation.
    q = zeros(1, 1, 8).expand(HUGE, 1, 8)
    for block_keys in (zeros(1, 0, 8), zeros(1, 1, 8)):
        with pytest.raises(ValueError, match="^q_idx: expected at most 2147483647 rows"):
            sparse_attn.qsa_indexer_mqa_score(q, block_keys, cu_seqlens_q=ints(0, 0),
                                              backend="reference")


def test_valid_call_whose_output_cannot_be_allocated_keeps_the_allocator_error():
    # Every argument is fine; the output really does not fit: the allocator's error stands.
    # 2**46 rows of 3 FP32 scores are 768 TiB, past the 128 TiB of a 47-bit user address space,
    # so the allocation fails under any overcommit policy. (HUGE rows' 12 TiB can be granted
    # where overcommit is always on, and the reference would then compute all of them.)
    rows = 2**46
    q = zeros(1, 4, 128).expand(rows, 4, 128)
    with pytest.raises(RuntimeError):
        sparse_attn.qsa_mqa_prefill(q, zeros(3, 128), ints(0).expand(rows), ints(0).expand(rows),
                                    backend="reference")


def test_block_count_products_that_overflow_int64_are_value_errors():
    table = torch.zeros((1, 1), dtype=I32).expand(1, 2**40)
    cache = zeros(1, 1, 1, 128).expand(1, 2**30, 1, 128)
    with pytest.raises(ValueError, match="^block_table: max_pages \\* page_size"):
        _C.qsa_indexer_mqa_score_shape(rand(1, 5, 4, 128), cache, table, None, None, None, None,
                                       None, None, 4, None, None, None, "reference")
    with pytest.raises(ValueError, match="^block_size: "):
        sparse_attn.find_blocks_chunked(torch.rand(1, 2, 2, 2), 0, 0.9, None, False,
                                        block_size=2**62, backend="reference")
