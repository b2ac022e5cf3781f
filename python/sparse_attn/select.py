"""QSA selection helpers: the steps between the indexer and sparse attention that the seed
leaves to the caller (docs/qsa.md, "Selection helpers"). Host tensors run on the CPU; CUDA
tensors run native kernels on torch's current stream (no host staging; graph-capturable)."""

from . import _C
from . import _runtime as rt

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
