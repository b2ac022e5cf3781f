"""XAttention entry points with the signatures of the reference code (mit-han-lab's
x-attention: xattn_estimate, find_blocks_chunked, Xattention_prefill) and of
Block-Sparse-Attention's block_sparse_attn_func. docs/xattention.md states the math.

Upstream parameters that select an implementation detail are accepted and ignored where
the result does not depend on them (use_triton, deterministic, chunk_size); parameters that
would change the result in a way the C++ library does not implement (softmax=False,
kdb != 1, num_to_choose, decoding, exact_streaming, return_attn_probs) raise
NotSupportedError naming the parameter, never a silent approximation. Keyword-only
extensions: backend ("native" or "reference"), out= (and lse=) for destination passing.
"""

import operator

from . import _C
from . import _runtime as rt

NotSupportedError = _C.NotSupportedError
BLOCK_SPARSE_BLOCK_SIZE = _C.BLOCK_SPARSE_BLOCK_SIZE


def _not_supported(name, message):
    raise NotSupportedError(f"{name}: {message}")


def _thresholds(threshold):
    """(threshold, head_thresholds): a number, or one value per query head (a sequence or a
    tensor, as upstream accepts)."""
    if threshold is None or isinstance(threshold, (int, float)):
        return threshold, None
    if getattr(threshold, "shape", None) == ():  # numpy scalar, 0-d tensor
        return float(threshold), None
    values = rt.host_list(threshold)
    if isinstance(values, (list, tuple)) and not values:
        # The binding reads an empty list as "no per-head thresholds", which would select
        # with the placeholder 0.0.
        raise ValueError("threshold: expected a number or one threshold per query head, got an "
                         "empty sequence")
    return 0.0, values


def _blocks(length, block_size):
    return (length + block_size - 1) // block_size


def _estimate_shape(query_states, key_states, block_size):
    q_shape = getattr(query_states, "shape", ())
    k_shape = getattr(key_states, "shape", ())
    if len(q_shape) == 4 and len(k_shape) == 4 and type(block_size) is int and block_size > 0:
        return (q_shape[0], q_shape[1], _blocks(q_shape[2], block_size),
                _blocks(k_shape[2], block_size))
    return tuple(_C.xattn_estimate_shape(query_states, key_states, block_size))


def _check_estimate_options(softmax, kdb):
    if softmax is not True:
        _not_supported("softmax", "only softmax=True (XAttention's estimate) is implemented")
    if kdb != 1:
        _not_supported("kdb", f"only kdb=1 is implemented, got {kdb!r}")


def xattn_estimate(query_states, key_states, block_size, stride, norm=1, softmax=True,
                   threshold=0.9, chunk_size=16384, select_mode="inverse", use_triton=True,
                   causal=True, kdb=1, keep_sink=False, keep_recent=False, *,
                   backend="native", out=None):
    """Antidiagonal block-importance estimate and threshold selection for query_states
    [B, Hq, Lq, D] and key_states [B, Hkv, Lk, D] (Lq <= Lk, bottom-right aligned). Returns
    (attn_sums FP32, simple_masks bool), both [B, Hq, ceil(Lq / block_size),
    ceil(Lk / block_size)]; out=(attn_sums, simple_masks) writes into given tensors.
    threshold may be one value per query head. use_triton is ignored."""
    _check_estimate_options(softmax, kdb)
    threshold, head_thresholds = _thresholds(threshold)
    options = (threshold, head_thresholds, causal, keep_sink, keep_recent, block_size, stride,
               norm, chunk_size, select_mode, backend)
    if out is None:
        shape = _estimate_shape(query_states, key_states, block_size)
        try:
            attn_sums = rt.empty(shape, query_states, "query_states", "float32")
            simple_masks = rt.empty(shape, query_states, "query_states", "bool")
        except rt.ALLOCATION_ERRORS as e:
            # The binding names the estimate's outputs out[0] and out[1].
            rt.explain_allocation_failure(e, ("out[0]", "out[1]"), lambda p: _C.xattn_estimate(
                query_states, key_states, p, p, *options, None))
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        attn_sums, simple_masks = out
    else:
        raise TypeError(f"out: expected a pair (attn_sums, simple_masks), got {rt.describe(out)}"
                        + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    rt.run(_C.xattn_estimate, "xattn_estimate", query_states,
           (query_states, key_states, attn_sums, simple_masks, *options))
    return attn_sums, simple_masks


def find_blocks_chunked(input_tensor, current_index, threshold, num_to_choose, decoding,
                        mode="both", causal=True, *, keep_sink=False, keep_recent=False,
                        block_size=128, backend="native", out=None):
    """Threshold selection over block sums input_tensor [B, H, q_blocks, k_blocks]: per query
    block, forced blocks, then the others by descending sum, kept while the sum before them
    is below threshold * the row's total. current_index is the key block of the first query
    block's diagonal (k_blocks - q_blocks for a chunk that ends at the last key); with causal,
    key blocks past the diagonal are never kept and the diagonal always is. Returns a bool
    mask of input_tensor's shape.

    Upstream's causal branch also always keeps key block 0; here that is keep_sink=True (the
    project's decision: the sink is opt-in, as in xattn_estimate)."""
    if num_to_choose is not None:
        _not_supported("num_to_choose", "choosing a fixed number of blocks is not implemented; "
                       "pass threshold and num_to_choose=None")
    if decoding:
        _not_supported("decoding", "the decode mode is not implemented; pass decoding=False")
    if mode not in ("both", "prefill"):
        _not_supported("mode", f"only 'both' and 'prefill' are implemented, got {mode!r}")
    if not hasattr(current_index, "__index__") or isinstance(current_index, bool):
        raise TypeError(f"current_index: expected an int, got {rt.describe(current_index)}")
    threshold, head_thresholds = _thresholds(threshold)
    shape = tuple(getattr(input_tensor, "shape", ()))
    options = (threshold, head_thresholds, causal, keep_sink, keep_recent, block_size, None, None,
               backend)
    if out is None:
        try:
            out = rt.empty(shape, input_tensor, "input_tensor", "bool")
        except rt.ALLOCATION_ERRORS as e:
            rt.explain_allocation_failure(
                e, ("out",), lambda p: _C.find_blocks_chunked(input_tensor, p, *options, None))
    if len(shape) == 4 and (causal or keep_recent) and current_index != shape[3] - shape[2]:
        # The diagonal of query block i is key block current_index + i: the blocks after the
        # last diagonal are past every query (never kept), and the call sees the rest.
        end = current_index + shape[2]
        if current_index < 0 or end > shape[3]:
            raise ValueError(f"current_index: expected 0 <= current_index <= k_blocks - "
                             f"q_blocks = {shape[3] - shape[2]}, got {current_index}")
        if not causal:
            _not_supported("current_index", "keep_recent without causal places the diagonal "
                           "at k_blocks - q_blocks only")
        # The slices would hide what is wrong with the whole arguments (out's shape, dtype or
        # layout, an overlap with input_tensor past `end`), and nothing may be written before
        # the checks: validate the call on the whole tensors first (at the default diagonal; a
        # selection over block sums costs little), then select on the blocks the call sees.
        rt.run(_C.find_blocks_chunked, "find_blocks_chunked", input_tensor,
               (input_tensor, out, *options))
        rt.run(_C.find_blocks_chunked, "find_blocks_chunked", input_tensor,
               (input_tensor[..., :end], out[..., :end], *options))
        out[..., end:] = False
        return out
    rt.run(_C.find_blocks_chunked, "find_blocks_chunked", input_tensor,
           (input_tensor, out, *options))
    return out


def block_sparse_attn_func(q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type, streaming_info,
                           base_blockmask, max_seqlen_q_, max_seqlen_k_, p_dropout,
                           deterministic=False, softmax_scale=None, is_causal=False,
                           exact_streaming=False, return_attn_probs=False, *,
                           backend="native", out=None, lse=None):
    """Block-sparse attention over 128x128 blocks, Block-Sparse-Attention's calling
    convention: q [total_q, Hq, D], k/v [total_k, Hkv, D], int32 cu_seqlens, head_mask_type
    [Hq] (1 block-sparse, 0 dense, -1 streaming; None: all 1), streaming_info [2 * Hq]
    (sink, local) for streaming heads, base_blockmask bool [B, sparse_heads, q_blocks,
    k_blocks]. Returns out [total_q, Hq, D]; lse= (FP32 [total_q, Hq]) is written when
    given. Forward only, p_dropout must be 0; deterministic is ignored (the forward is)."""
    if exact_streaming:
        _not_supported("exact_streaming", "not implemented; pass exact_streaming=False")
    if return_attn_probs:
        _not_supported("return_attn_probs", "attention probabilities are not returned; pass "
                       "lse= for the log-sum-exp")
    head_mask_type, streaming_info = rt.host_list(head_mask_type), rt.host_list(streaming_info)
    if out is None:
        try:
            out = rt.empty(tuple(getattr(q, "shape", ())), q, "q")
        except rt.ALLOCATION_ERRORS as e:
            rt.explain_allocation_failure(e, ("out",), lambda p: _C.block_sparse_attention(
                q, k, v, cu_seqlens_q, cu_seqlens_k, base_blockmask, max_seqlen_q_,
                max_seqlen_k_, p, lse, head_mask_type, streaming_info, softmax_scale, is_causal,
                p_dropout, backend, None))
    rt.run(_C.block_sparse_attention, "block_sparse_attention", q,
           (q, k, v, cu_seqlens_q, cu_seqlens_k, base_blockmask, max_seqlen_q_, max_seqlen_k_,
            out, lse, head_mask_type, streaming_info, softmax_scale, is_causal, p_dropout,
            backend))
    return out


def block_sparse_attn_paged_func(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q,
                                 base_blockmask, max_seqlen_q, max_seqlen_k, *,
                                 head_mask_type=None, streaming_info=None, softmax_scale=None,
                                 is_causal=True, backend="native", out=None, lse=None):
    """block_sparse_attn_func over a paged KV cache: k_cache/v_cache [num_pages, page_size,
    Hkv, D] (any page_size), block_table int32 [B, max_pages],
    seqlens_k int32 [B]. An extension (Block-Sparse-Attention has no paged entry point)."""
    head_mask_type, streaming_info = rt.host_list(head_mask_type), rt.host_list(streaming_info)
    if out is None:
        try:
            out = rt.empty(tuple(getattr(q, "shape", ())), q, "q")
        except rt.ALLOCATION_ERRORS as e:
            rt.explain_allocation_failure(e, ("out",), lambda p: _C.block_sparse_attention_paged(
                q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, base_blockmask,
                max_seqlen_q, max_seqlen_k, p, lse, head_mask_type, streaming_info,
                softmax_scale, is_causal, 0.0, backend, None))
    rt.run(_C.block_sparse_attention_paged, "block_sparse_attention_paged", q,
           (q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, base_blockmask,
            max_seqlen_q, max_seqlen_k, out, lse, head_mask_type, streaming_info, softmax_scale,
            is_causal, 0.0, backend))
    return out


def Xattention_prefill(query_states, key_states, value_states, stride, norm=1, threshold=0.8,
                       block_size=128, use_triton=True, causal=True, kdb=1, chunk_size=None,
                       keep_sink=False, keep_recent=False, *, backend="native",
                       softmax_scale=None, out=None, lse=None):
    """XAttention prefill: xattn_estimate, then block-sparse attention with every head
    block-sparse. query_states [B, Hq, Lq, D], key/value_states [B, Hkv, Lk, D]; returns the
    attention output [B, Hq, Lq, D] (exactly out= when given); lse= (FP32 [B, Hq, Lq]) is
    written when given. chunk_size None uses the default (it never changes the result)."""
    _check_estimate_options(True, kdb)
    threshold, head_thresholds = _thresholds(threshold)
    options = (threshold, head_thresholds, causal, keep_sink, keep_recent, block_size, stride,
               norm, 16384 if chunk_size is None else chunk_size, "inverse", softmax_scale,
               backend)
    shape = _estimate_shape(query_states, key_states, block_size)
    out_given = out is not None
    try:
        attn_sums = rt.empty(shape, query_states, "query_states", "float32")
        block_mask = rt.empty(shape, query_states, "query_states", "bool")
        if out is None:
            out = rt.empty(tuple(query_states.shape), query_states, "query_states")
    except rt.ALLOCATION_ERRORS as e:
        # attn_sums and block_mask are the binding's names of the scratch outputs.
        rt.explain_allocation_failure(
            e, ("attn_sums", "block_mask") + (() if out_given else ("out",)),
            lambda p: _C.xattention_prefill(query_states, key_states, value_states, p, p,
                                            out if out_given else p, lse, *options, None))
    rt.run(_C.xattention_prefill, "xattention_prefill", query_states,
           (query_states, key_states, value_states, attn_sums, block_mask, out, lse, *options))
    return out


def xattention_prefill_paged(query_states, k_cache, v_cache, block_table, k_len, stride, norm=1,
                             threshold=0.8, block_size=128, causal=True, chunk_size=None,
                             keep_sink=False, keep_recent=False, *, backend="native",
                             softmax_scale=None, out=None, lse=None):
    """Xattention_prefill over a paged KV cache (an extension: upstream has no paged prefill):
    query_states [B, Hq, Lq, D]; k_cache / v_cache [num_pages, page_size, Hkv, D] (any
    page_size, any strides with the head dim contiguous); block_table int [B, max_pages], key t
    of request b in page block_table[b, t // page_size]; every request has k_len keys, its query
    rows the last Lq of them. The result is Xattention_prefill's on the gathered keys and values
    (on the GPU gathered into stream-ordered scratch of 2 B k_len Hkv D elements)."""
    threshold, head_thresholds = _thresholds(threshold)
    options = (threshold, head_thresholds, causal, keep_sink, keep_recent, block_size, stride,
               norm, 16384 if chunk_size is None else chunk_size, "inverse", softmax_scale,
               backend)
    try:
        k_len = operator.index(k_len)
    except TypeError:
        raise TypeError(f"k_len: expected an int, got {type(k_len).__name__}") from None
    q_shape = tuple(getattr(query_states, "shape", ()))
    if len(q_shape) != 4 or type(block_size) is not int or block_size <= 0:
        # Malformed: the library's validation names the argument, and fails before it touches
        # the outputs (query_states stands in for them).
        _C.xattention_prefill_paged(query_states, k_cache, v_cache, block_table, k_len,
                                    query_states, query_states, query_states, lse, *options, None)
    shape = (q_shape[0], q_shape[1], _blocks(q_shape[2], block_size), _blocks(k_len, block_size))
    out_given = out is not None
    try:
        attn_sums = rt.empty(shape, query_states, "query_states", "float32")
        block_mask = rt.empty(shape, query_states, "query_states", "bool")
        if out is None:
            out = rt.empty(q_shape, query_states, "query_states")
    except rt.ALLOCATION_ERRORS as e:
        rt.explain_allocation_failure(
            e, ("attn_sums", "block_mask") + (() if out_given else ("out",)),
            lambda p: _C.xattention_prefill_paged(query_states, k_cache, v_cache, block_table,
                                                  k_len, p, p, out if out_given else p, lse,
                                                  *options, None))
    rt.run(_C.xattention_prefill_paged, "xattention_prefill_paged", query_states,
           (query_states, k_cache, v_cache, block_table, k_len, attn_sums, block_mask, out, lse,
            *options))
    return out
