"""QSA (Qwen Sparse Attention) entry points with the seed's (MATE's) signatures.

docs/qsa.md states the math and edge cases; the C++ reference backend is its executable
form. Each function validates through the C++ API (errors name the argument), allocates its
outputs like the first tensor argument unless ``out=`` is given, and runs on torch's current
CUDA stream. ``backend="tilelang"`` is an alias of ``"native"``; ``"reference"`` is the
oracle. ``out=`` on the scoring functions is an extension of the seed's signatures
(destination passing, e.g. for CUDA graphs).
"""

from . import _C
from . import _runtime as rt

try:
    import torch

    _BF16 = torch.bfloat16
    _F32 = torch.float32
    _empty = torch.empty
except ImportError:
    _BF16 = "bfloat16"


def _rank(x):
    shape = getattr(x, "shape", None)
    return -1 if shape is None else len(shape)


def _cache_dtype(x):
    # kv_cache_dtype as the custom ops' schema carries it (a str or None): torch dtypes by name.
    if x is None or isinstance(x, str):
        return x
    name = str(x)
    return name[len("torch."):] if name.startswith("torch.") else x


def _is_int(x):
    # int, numpy integers and torch.SymInt (under torch.compile); not bool, float or str.
    return hasattr(x, "__index__") and not isinstance(x, bool) and not hasattr(x, "__dlpack__")


def _indexer_score_shape(q_idx, block_keys, block_table):
    # Mirrors qsa_indexer_mqa_score_shape for well-formed ranks; anything else returns None
    # so that the C++ shape function raises its error.
    if _rank(q_idx) not in (3, 4):
        return None
    if block_table is None:
        if _rank(block_keys) != 3:
            return None
        num_blocks = block_keys.shape[1]
    else:
        if _rank(block_table) != 2 or _rank(block_keys) not in (3, 4):
            return None
        num_blocks = block_table.shape[1] * block_keys.shape[1]
    return (*q_idx.shape[: _rank(q_idx) - 2], num_blocks)


def qsa_indexer_mqa_score(
    q_idx,
    block_keys,
    *,
    block_table=None,
    page_size=None,
    cu_seqlens_q=None,
    token_to_req=None,
    num_requests=None,
    query_positions=None,
    seq_lens_q=None,
    block_size=4,
    scale=None,
    score_scale=None,
    backend="tilelang",
    out=None,
    kv_cache_dtype=None,
):
    """QSA MQA block scores: FP32 [B, Q, N_B] (padded q_idx [B, Q, 4, 128]) or [total_q, N_B]
    (varlen), -inf for blocks whose last token is not visible. With block_table, block_keys
    is a paged cache [pages, page_size, (1,) 128]. scale multiplies (default 1/sqrt(D)),
    score_scale divides; not both. Does not select top-k (see select_topk_blocks).
    block_keys may be FP8 e4m3 (torch.float8_e4m3fn, or uint8 with kv_cache_dtype="fp8"),
    used unscaled, on every backend."""
    options = (block_table, page_size, cu_seqlens_q, token_to_req, num_requests,
               query_positions, seq_lens_q, block_size, scale, score_scale,
               _cache_dtype(kv_cache_dtype), backend)
    if out is None:
        shape = _indexer_score_shape(q_idx, block_keys, block_table)
        if shape is None:
            shape = _C.qsa_indexer_mqa_score_shape(q_idx, block_keys, *options)
        try:
            out = rt.empty(shape, q_idx, "q_idx", "float32")
        except rt.ALLOCATION_ERRORS as e:
            rt.explain_allocation_failure(e, ("out",), lambda p: _C.qsa_indexer_mqa_score(
                q_idx, block_keys, p, *options, None))
    rt.run(_C.qsa_indexer_mqa_score, "qsa_indexer_mqa_score", q_idx,
           (q_idx, block_keys, out, *options))
    return out


def qsa_mqa_prefill(q, k, row_starts, row_ends, score_scale=None, *, scale=None,
                    backend="tilelang", out=None, kv_cache_dtype=None):
    """Packed-prefill MQA logits: FP32 [rows, keys], -inf outside [row_starts, row_ends) of
    each row. q [rows, heads, dim]; k [keys, dim] or [keys, 1, dim], q's dtype or FP8 e4m3
    (as in qsa_indexer_mqa_score)."""
    kv_cache_dtype = _cache_dtype(kv_cache_dtype)
    if out is None:
        if _rank(q) == 3 and _rank(k) in (2, 3):
            shape = (q.shape[0], k.shape[0])
        else:
            shape = _C.qsa_mqa_prefill_shape(q, k, kv_cache_dtype)
        try:
            out = rt.empty(shape, q, "q", "float32")
        except rt.ALLOCATION_ERRORS as e:
            rt.explain_allocation_failure(e, ("out",), lambda p: _C.qsa_mqa_prefill(
                q, k, row_starts, row_ends, p, score_scale, scale, kv_cache_dtype, backend,
                None))
    rt.run(_C.qsa_mqa_prefill, "qsa_mqa_prefill", q,
           (q, k, row_starts, row_ends, out, score_scale, scale, kv_cache_dtype, backend))
    return out


def qsa_mqa(q, k, row_starts, row_ends, score_scale=None, *, scale=None, backend="tilelang",
            out=None, kv_cache_dtype=None):
    """The seed's other name of qsa_mqa_prefill."""
    return qsa_mqa_prefill(q, k, row_starts, row_ends, score_scale, scale=scale,
                           backend=backend, out=out, kv_cache_dtype=kv_cache_dtype)


def qsa_mqa_decode(q, k_cache, page_table, context_lens, max_model_len, score_scale=None, *,
                   scale=None, backend="tilelang", out=None, kv_cache_dtype=None):
    """Paged-decode MQA logits: FP32 [B * R, max_model_len] (request b's query row r is row
    b * R + r); columns at or past the row's context_len and those behind a missing page (-1
    or out of range) are -inf. q [B, heads, dim] (R = 1) or [B, R, heads, dim] (multi-token
    decode; native CUDA takes R <= 4); context_lens [B, R], one count per query row, or [B]
    when R = 1; k_cache [pages, page_size, (1,) dim], q's dtype or FP8 e4m3 (as in
    qsa_indexer_mqa_score)."""
    kv_cache_dtype = _cache_dtype(kv_cache_dtype)
    if out is None:
        fast = (type(q) is rt._Tensor and type(max_model_len) is int and max_model_len >= 0
                and q.dim() in (3, 4))
        if not fast:
            # A negative width or an empty row axis goes to the C++ shape function, which names
            # it.
            if (_rank(q) in (3, 4) and _is_int(max_model_len) and max_model_len >= 0
                    and (_rank(q) == 3 or q.shape[1] >= 1)):
                shape = (_decode_out_rows(q), max_model_len)
            else:
                shape = _C.qsa_mqa_decode_shape(q, max_model_len)
        try:
            if fast:
                # Eager torch, the serving path (0.4 us less than the general one).
                out = _empty(_decode_out_rows(q), max_model_len, dtype=_F32, device=q.device)
            else:
                out = rt.empty(shape, q, "q", "float32")
        except rt.ALLOCATION_ERRORS as e:
            rt.explain_allocation_failure(e, ("out",), lambda p: _C.qsa_mqa_decode(
                q, k_cache, page_table, context_lens, max_model_len, p, score_scale, scale,
                kv_cache_dtype, backend, None))
    rt.run(_C.qsa_mqa_decode, "qsa_mqa_decode", q,
           (q, k_cache, page_table, context_lens, max_model_len, out, score_scale, scale,
            kv_cache_dtype, backend))
    return out


def _decode_out_rows(q):
    # B * R output rows: a [B, heads, dim] query is one row per request.
    return q.shape[0] if len(q.shape) == 3 else q.shape[0] * q.shape[1]


def qsa_sparse_attention(
    query,
    key,
    value,
    token_indices=None,
    *,
    block_indices=None,
    cu_seqlens_q=None,
    token_to_req=None,
    num_requests=None,
    cu_seqlens_k=None,
    seq_lens_q=None,
    seq_lens_k=None,
    query_positions=None,
    block_table=None,
    page_size=None,
    scale=None,
    gate=None,
    num_splits=None,
    return_lse=False,
    backend="tilelang",
    warp_specialized=False,
    assume_compact_blocks=False,
    out=None,
    selected_kv_indices=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    compute_dtype=_BF16,
    lse=None,
    workspace=None,
    kv_cache_dtype=None,
):
    """QSA core attention over each query row's selected tokens (request-local
    token_indices, -1 pads, shared by all query heads; or physical selected_kv_indices).
    Returns the query-shaped output (exactly `out` when given), or (out, lse) when
    return_lse; lse is FP32 query.shape[:-1], natural log, -inf for rows with no valid
    token, and is written whenever given.

    workspace (an extension of the seed's signature): a uint8 buffer of at least
    qsa_sparse_attention_workspace_size(...) bytes on the query's device, or a callable
    that returns one given the byte count (called only when the call needs scratch), for
    callers that own every allocation. Omitted, the call allocates what it needs (SplitKV
    partials, the row-rank pass; often nothing) with the query's framework: torch's caching
    allocator.

    FP8 K/V (an extension): key and value both torch.float8_e4m3fn, or uint8 storage with
    kv_cache_dtype="fp8" (or "fp8_e4m3", vLLM's names); the value used is stored value x
    k_scale (v_scale), in FP32. 16-bit K/V need k_scale == v_scale == 1. The reference and
    CPU backends read FP8; the native CUDA kernels do not yet (NotSupportedError)."""
    kv_cache_dtype = _cache_dtype(kv_cache_dtype)
    if return_lse is not True and return_lse is not False:
        rt.require_bool(return_lse, "return_lse")
    if type(query) is rt._Tensor and not (rt.ops_registered and rt._is_compiling()):
        # Eager torch, the serving path: allocate and call the binding directly (it checks
        # every argument; a query of the wrong rank takes the general path for its error).
        shape = query.shape
        if len(shape) in (3, 4):
            try:
                if out is None:
                    out = _empty(*shape, dtype=query.dtype, device=query.device)
                if return_lse and lse is None:
                    lse = _empty(*shape[:-1], dtype=_F32, device=query.device)
            except rt.ALLOCATION_ERRORS as e:
                _explain_attention_allocation(e, out, lse, return_lse, (
                    query, key, value, token_indices, block_indices, cu_seqlens_q, token_to_req,
                    num_requests, cu_seqlens_k, seq_lens_q, seq_lens_k, query_positions,
                    block_table, page_size, scale, gate, num_splits, backend, warp_specialized,
                    assume_compact_blocks, selected_kv_indices, softmax_scale, k_scale, v_scale,
                    compute_dtype, kv_cache_dtype))
            if query.is_cuda:
                stream = rt.torch_stream(query)
                if workspace is None:
                    workspace = rt.workspace_allocator(query)
            else:
                stream = None
            _C.qsa_sparse_attention(
                query, key, value, token_indices, out, lse, block_indices, cu_seqlens_q,
                token_to_req, num_requests, cu_seqlens_k, seq_lens_q, seq_lens_k,
                query_positions, block_table, page_size, scale, gate, num_splits, backend,
                warp_specialized, assume_compact_blocks, selected_kv_indices, softmax_scale,
                k_scale, v_scale, compute_dtype, kv_cache_dtype, workspace, stream)
            return (out, lse) if return_lse else out
    out_shape = lse_shape = None
    if out is None:
        out_shape = tuple(query.shape) if _rank(query) in (3, 4) else \
            _C.qsa_sparse_attention_out_shape(query)
    if return_lse and lse is None:
        lse_shape = tuple(query.shape[:-1]) if _rank(query) in (3, 4) else \
            _C.qsa_sparse_attention_lse_shape(query)
    try:
        if out_shape is not None:
            out = rt.empty(out_shape, query, "query")
        if lse_shape is not None:
            lse = rt.empty(lse_shape, query, "query", "float32")
    except rt.ALLOCATION_ERRORS as e:
        _explain_attention_allocation(e, out, lse, return_lse, (
            query, key, value, token_indices, block_indices, cu_seqlens_q, token_to_req,
            num_requests, cu_seqlens_k, seq_lens_q, seq_lens_k, query_positions, block_table,
            page_size, scale, gate, num_splits, backend, warp_specialized,
            assume_compact_blocks, selected_kv_indices, softmax_scale, k_scale, v_scale,
            compute_dtype, kv_cache_dtype))
    args = (query, key, value, token_indices, out, lse, block_indices, cu_seqlens_q,
            token_to_req, num_requests, cu_seqlens_k, seq_lens_q, seq_lens_k, query_positions,
            block_table, page_size, scale, gate, num_splits, backend, warp_specialized,
            assume_compact_blocks, selected_kv_indices, softmax_scale, k_scale, v_scale,
            compute_dtype, kv_cache_dtype)
    if isinstance(query, rt._Tensor) and rt.ops_registered and rt._is_compiling():
        # The custom op takes tensors only; it allocates a missing workspace when it runs.
        torch.ops.sparse_attn.qsa_sparse_attention(*args, workspace)
    else:
        if workspace is None:
            workspace = rt.workspace_allocator(query)
        rt.run(_C.qsa_sparse_attention, "qsa_sparse_attention", query, (*args, workspace))
    return (out, lse) if return_lse else out


def _explain_attention_allocation(error, out, lse, return_lse, args):
    # args: qsa_sparse_attention's arguments in the binding's order, less out and lse. The
    # outputs still unallocated (None) get the placeholder.
    missing = (("out",) if out is None else ()) + (("lse",) if return_lse and lse is None else ())

    def validate(placeholder):
        o = placeholder if out is None else out
        l = placeholder if return_lse and lse is None else lse
        _C.qsa_sparse_attention(*args[:4], o, l, *args[4:], None, None)

    rt.explain_allocation_failure(error, missing, validate)


def qsa_sparse_attention_workspace_size(
    query,
    key,
    value,
    token_indices=None,
    *,
    block_indices=None,
    cu_seqlens_q=None,
    token_to_req=None,
    num_requests=None,
    cu_seqlens_k=None,
    seq_lens_q=None,
    seq_lens_k=None,
    query_positions=None,
    block_table=None,
    page_size=None,
    scale=None,
    gate=None,
    num_splits=None,
    backend="tilelang",
    warp_specialized=False,
    assume_compact_blocks=False,
    selected_kv_indices=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    compute_dtype=_BF16,
    return_lse=False,
    out=None,
    lse=None,
    workspace=None,
    kv_cache_dtype=None,
):
    """Bytes of the `workspace=` a qsa_sparse_attention call with these arguments needs (0
    when none: the reference backend, CPU tensors, no query rows, one KV split without the
    row-rank pass). Decided from shapes and options on the host; the same for every call
    with the same shapes and options on the same device, so one buffer serves a whole
    decode loop or CUDA graph. Takes every keyword of qsa_sparse_attention, so that a
    call's keywords can be reused as they are; return_lse, out, lse and workspace do not
    change the size."""
    return _C.qsa_sparse_attention_workspace_size(
        query, key, value, token_indices, block_indices, cu_seqlens_q, token_to_req,
        num_requests, cu_seqlens_k, seq_lens_q, seq_lens_k, query_positions, block_table,
        page_size, scale, gate, num_splits, backend, warp_specialized, assume_compact_blocks,
        selected_kv_indices, softmax_scale, k_scale, v_scale, compute_dtype,
        _cache_dtype(kv_cache_dtype))
