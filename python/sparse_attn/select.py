"""QSA selection helpers: the steps between the indexer and sparse attention that the seed
leaves to the caller (docs/qsa.md, "Selection helpers"). Host tensors run on the CPU; CUDA
tensors run native kernels on torch's current stream (no host staging; graph-capturable).
The fused selections (qsa_indexer_select, qsa_mqa_decode_select) score and select in one op,
with the score ops' keywords and backends."""

from . import _C
from . import _runtime as rt
from .qsa import _cache_dtype, _decode_out_rows, _indexer_score_shape, _rank

QSA_TOPK_BLOCKS = _C.QSA_TOPK_BLOCKS


def qsa_topk_blocks(scores, k=QSA_TOPK_BLOCKS, *, out=None):
    """Per row of FP32 scores [rows, N_B] or [B, Q, N_B] (qsa_indexer_mqa_score /
    qsa_mqa_decode output): the ids of the k highest finite scores, highest first, ties to
    the lower block id; fewer than k visible blocks: all of them, then -1. Returns int32
    scores.shape[:-1] + (k,)."""
    if out is None:
        rank = len(getattr(scores, "shape", ()))
        shape = (*scores.shape[:-1], k) if rank in (2, 3) and type(k) is int else \
            _C.qsa_topk_blocks_shape(scores, k)
        try:
            out = rt.empty(shape, scores, "scores", "int32")
        except rt.ALLOCATION_ERRORS as e:
            rt.explain_allocation_failure(
                e, ("out",), lambda p: _C.qsa_topk_blocks(scores, k, p, None))
    rt.run(_C.qsa_topk_blocks, "qsa_topk_blocks", scores, (scores, k, out))
    return out


def qsa_expand_blocks(block_ids, query_positions, *, return_block_indices=False,
                      token_indices=None, block_indices=None):
    """Expands selected blocks to the request-local token ids qsa_sparse_attention takes:
    each kept block b (b >= 0 and 4b + 3 <= position) -> 4b..4b+3 in input order, then the
    tail 4 * ((p + 1) // 4) .. p of the current block, then -1 up to width 4k + 3 (2051 for
    k = 512). Returns token_indices, or (token_indices, block_indices) when
    return_block_indices (the kept ids in input order, then -1: the block hint). Outputs
    given as token_indices= / block_indices= are written and returned."""
    rt.require_bool(return_block_indices, "return_block_indices")
    rank = len(getattr(block_ids, "shape", ()))
    if rank not in (2, 3):
        # Not a [rows, k] / [B, Q, k] tensor: the shape function raises the error naming
        # block_ids (block_ids.shape below is not there to read).
        _C.qsa_expand_blocks_token_shape(block_ids)
    if token_indices is None:
        token_shape = (*block_ids.shape[:-1], 4 * block_ids.shape[-1] + 3)
    try:
        if token_indices is None:
            token_indices = rt.empty(token_shape, block_ids, "block_ids", "int32")
        if return_block_indices and block_indices is None:
            block_indices = rt.empty(tuple(block_ids.shape), block_ids, "block_ids", "int32")
    except rt.ALLOCATION_ERRORS as e:
        # The outputs still None are the ones that could not be allocated.
        tokens_missing = token_indices is None
        blocks_missing = return_block_indices and block_indices is None
        missing = (("token_indices",) if tokens_missing else ()) + \
            (("block_indices",) if blocks_missing else ())
        rt.explain_allocation_failure(e, missing, lambda p: _C.qsa_expand_blocks(
            block_ids, query_positions, p if tokens_missing else token_indices,
            p if blocks_missing else block_indices, None))
    rt.run(_C.qsa_expand_blocks, "qsa_expand_blocks", block_ids,
           (block_ids, query_positions, token_indices, block_indices))
    return (token_indices, block_indices) if return_block_indices else token_indices


# --------------------------------------------------------------------------------------------
# Fused selection: the indexer's scores, top-k and expansion in one op (docs/qsa.md, "Fused
# selection")
# --------------------------------------------------------------------------------------------

def _selection(out, token_indices, valid_counts, return_tokens, return_valid_counts):
    if not return_tokens and not return_valid_counts:
        return out
    return (out,) + ((token_indices,) if return_tokens else ()) + \
        ((valid_counts,) if return_valid_counts else ())


def _allocate_selection(rows, topk, like, name, out, token_indices, valid_counts, return_tokens,
                        return_valid_counts, validate):
    """Allocates the outputs the caller did not give and the flags ask for (int32 rows +
    (topk,), rows + (4 topk + 3,), rows) like `like`. An allocation failure raises the call's
    own error first: validate(out, token_indices, valid_counts) runs the binding with the
    placeholder in place of each output that could not be allocated."""
    try:
        if out is None:
            out = rt.empty((*rows, topk), like, name, "int32")
        if return_tokens and token_indices is None:
            token_indices = rt.empty((*rows, 4 * topk + 3), like, name, "int32")
        if return_valid_counts and valid_counts is None:
            valid_counts = rt.empty(tuple(rows), like, name, "int32")
    except rt.ALLOCATION_ERRORS as e:
        # The outputs still None are the ones that could not be allocated.
        names = (("out",) if out is None else ()) + \
            (("token_indices",) if return_tokens and token_indices is None else ()) + \
            (("valid_counts",) if return_valid_counts and valid_counts is None else ())
        rt.explain_allocation_failure(e, names, lambda p: validate(
            p if out is None else out,
            p if return_tokens and token_indices is None else token_indices,
            p if return_valid_counts and valid_counts is None else valid_counts))
    return out, token_indices, valid_counts


def _is_topk(topk):
    return type(topk) is int and topk >= 1


def qsa_indexer_select(
    q_idx,
    block_keys,
    topk=QSA_TOPK_BLOCKS,
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
    kv_cache_dtype=None,
    out=None,
    return_tokens=False,
    token_indices=None,
    valid_counts=None,
    return_valid_counts=False,
    max_workspace_bytes=None,
    workspace=None,
):
    """qsa_topk_blocks(qsa_indexer_mqa_score(q_idx, block_keys, ...), topk) in one op, without
    the FP32 score matrix: int32 [B, Q, topk] (padded q_idx) or [total_q, topk] (varlen), the
    best visible blocks of each row, score descending, ties to the lower id, then -1; padding
    rows all -1. Takes every keyword of qsa_indexer_mqa_score. return_tokens adds
    token_indices (qsa_expand_blocks of the ids at each row's position, int32 rows + (4 topk +
    3,); padding rows all -1), return_valid_counts valid_counts (int32, the entries >= 0 of
    each row's token_indices): the result is then the tuple (out, [token_indices,]
    [valid_counts]). Outputs given as out= / token_indices= / valid_counts= are written (and
    returned as those objects). Rows are scored and selected in chunks whose scores fit
    max_workspace_bytes (default 1 GiB, at least one row's: 4 * N_B); workspace: a uint8 scratch
    buffer of qsa_indexer_select_workspace_size(...) bytes for native CUDA (omitted: the
    library's pool)."""
    rt.require_bool(return_tokens, "return_tokens")
    rt.require_bool(return_valid_counts, "return_valid_counts")
    options = (block_table, page_size, cu_seqlens_q, token_to_req, num_requests,
               query_positions, seq_lens_q, block_size, scale, score_scale,
               _cache_dtype(kv_cache_dtype), backend)
    if out is None or (return_tokens and token_indices is None) or \
            (return_valid_counts and valid_counts is None):
        shape = _indexer_score_shape(q_idx, block_keys, block_table) if _is_topk(topk) else None
        if shape is None:
            shape = _C.qsa_indexer_select_shape(q_idx, block_keys, topk, *options)
        out, token_indices, valid_counts = _allocate_selection(
            tuple(shape[:-1]), topk, q_idx, "q_idx", out, token_indices, valid_counts,
            return_tokens, return_valid_counts,
            lambda o, t, c: _C.qsa_indexer_select(q_idx, block_keys, topk, o, t, c, *options,
                                                  max_workspace_bytes, workspace, None))
    rt.run(_C.qsa_indexer_select, "qsa_indexer_select", q_idx,
           (q_idx, block_keys, topk, out, token_indices, valid_counts, *options,
            max_workspace_bytes, workspace))
    return _selection(out, token_indices, valid_counts, return_tokens, return_valid_counts)


def qsa_indexer_select_workspace_size(
    q_idx,
    block_keys,
    topk=QSA_TOPK_BLOCKS,
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
    kv_cache_dtype=None,
    out=None,
    return_tokens=False,
    token_indices=None,
    valid_counts=None,
    return_valid_counts=False,
    max_workspace_bytes=None,
    workspace=None,
):
    """Bytes of the workspace= a qsa_indexer_select call with these arguments needs on native
    CUDA (0 for the reference backend, CPU tensors and builds without CUDA); decided from
    shapes and options, the same for every call with the same ones. Takes every keyword of
    the call; of the outputs only whether token_indices / valid_counts are written counts."""
    rt.require_bool(return_tokens, "return_tokens")
    rt.require_bool(return_valid_counts, "return_valid_counts")
    tokens = _C.MISSING_OUTPUT if return_tokens or token_indices is not None else None
    counts = _C.MISSING_OUTPUT if return_valid_counts or valid_counts is not None else None
    return _C.qsa_indexer_select_workspace_size(
        q_idx, block_keys, topk, tokens, counts, block_table, page_size, cu_seqlens_q,
        token_to_req, num_requests, query_positions, seq_lens_q, block_size, scale, score_scale,
        _cache_dtype(kv_cache_dtype), backend, max_workspace_bytes)


def _decode_rows(q):
    # [B * R] for well-formed q ranks; None for the C++ shape function to name what is wrong.
    if _rank(q) == 3 or (_rank(q) == 4 and q.shape[1] >= 1):
        return (_decode_out_rows(q),)
    return None


def qsa_mqa_decode_select(
    q,
    k_cache,
    page_table,
    context_lens,
    max_model_len,
    topk=QSA_TOPK_BLOCKS,
    *,
    query_positions=None,
    score_scale=None,
    scale=None,
    backend="tilelang",
    kv_cache_dtype=None,
    out=None,
    return_tokens=False,
    token_indices=None,
    valid_counts=None,
    return_valid_counts=False,
    max_workspace_bytes=None,
    workspace=None,
):
    """qsa_topk_blocks(qsa_mqa_decode(q, k_cache, page_table, context_lens, max_model_len,
    ...), topk) in one op: int32 [B * R, topk] (request b's row r at row b * R + r). A row with
    context_lens <= 0 or a negative query_positions (int [B, R], or [B] when R = 1) is a
    padding row: all -1. return_tokens / return_valid_counts, the outputs, max_workspace_bytes
    and workspace as in qsa_indexer_select; token_indices and valid_counts need
    query_positions, the position each row expands at."""
    rt.require_bool(return_tokens, "return_tokens")
    rt.require_bool(return_valid_counts, "return_valid_counts")
    kv_cache_dtype = _cache_dtype(kv_cache_dtype)

    def args(o, t, c):
        return (q, k_cache, page_table, context_lens, max_model_len, topk, o, t, c,
                query_positions, score_scale, scale, kv_cache_dtype, backend, max_workspace_bytes,
                workspace)

    if out is None or (return_tokens and token_indices is None) or \
            (return_valid_counts and valid_counts is None):
        rows = _decode_rows(q) if _is_topk(topk) else None
        if rows is None:
            rows = tuple(_C.qsa_mqa_decode_select_shape(q, topk))[:-1]
        out, token_indices, valid_counts = _allocate_selection(
            rows, topk, q, "q", out, token_indices, valid_counts, return_tokens,
            return_valid_counts, lambda o, t, c: _C.qsa_mqa_decode_select(*args(o, t, c), None))
    rt.run(_C.qsa_mqa_decode_select, "qsa_mqa_decode_select", q,
           args(out, token_indices, valid_counts))
    return _selection(out, token_indices, valid_counts, return_tokens, return_valid_counts)


def qsa_mqa_decode_select_workspace_size(
    q,
    k_cache,
    page_table,
    context_lens,
    max_model_len,
    topk=QSA_TOPK_BLOCKS,
    *,
    query_positions=None,
    score_scale=None,
    scale=None,
    backend="tilelang",
    kv_cache_dtype=None,
    out=None,
    return_tokens=False,
    token_indices=None,
    valid_counts=None,
    return_valid_counts=False,
    max_workspace_bytes=None,
    workspace=None,
):
    """As qsa_indexer_select_workspace_size, for qsa_mqa_decode_select."""
    rt.require_bool(return_tokens, "return_tokens")
    rt.require_bool(return_valid_counts, "return_valid_counts")
    tokens = _C.MISSING_OUTPUT if return_tokens or token_indices is not None else None
    counts = _C.MISSING_OUTPUT if return_valid_counts or valid_counts is not None else None
    return _C.qsa_mqa_decode_select_workspace_size(
        q, k_cache, page_table, context_lens, max_model_len, topk, tokens, counts,
        query_positions, score_scale, scale, _cache_dtype(kv_cache_dtype), backend,
        max_workspace_bytes)
