"""Context parallelism on torch.distributed: one request's K/V cache (and QSA's compressed
indexer cache) sharded by sequence over the ranks of a process group.

Each rank holds a contiguous range of the sequence, attends to the part of each query row's
selection that lies in its range, and the ranks combine their partial results exactly through
their log-sum-exp (``sparse_attn.merge_attention_states``, rank order 0 .. N-1, so the result
is the same on every rank and every run). docs/distributed.md states the design, what is
communicated, the rules and the limits.

The queries are replicated: every rank passes the same query rows (and the same token
selections, gate, positions). Every collective is one ``all_gather_into_tensor`` of one packed
buffer per step (``all_gather`` for process-group backends other than NCCL and gloo), on the
group given (default: the world), so the functions run on NCCL with CUDA tensors and on gloo
with CPU tensors alike.

Two layers:

* the sharded functions (``qsa_topk_blocks_sharded``, ``qsa_sparse_attention_sharded``,
  ``xattn_block_sparse_sharded``): per-rank piece, gather, merge;
* the per-rank pieces and the merge steps they are made of, usable without a process group
  (``qsa_topk_blocks_local`` / ``qsa_topk_merge``, ``qsa_sparse_attention_shard``,
  ``xattn_block_sparse_shard``, ``all_gather_states`` / ``merge_shard_states``).
"""

import math
import operator
import zlib

import torch
import torch.distributed as dist

from . import _C
from .merge import merge_attention_states
from .qsa import qsa_sparse_attention
from .select import QSA_TOPK_BLOCKS, qsa_indexer_select, qsa_topk_blocks
from .xattn import Xattention_prefill, block_sparse_attn_func

NotSupportedError = _C.NotSupportedError
BLOCK = _C.BLOCK_SPARSE_BLOCK_SIZE  # 128: XAttention shards hold whole key blocks
_HINT_MAX_BLOCKS = 512  # qsa_sparse_attention's block hint: at most 512 blocks (docs/qsa.md)

__all__ = [
    "all_gather_sequence",
    "all_gather_states",
    "merge_shard_states",
    "qsa_sparse_attention_shard",
    "qsa_sparse_attention_sharded",
    "qsa_prefill_context_parallel",
    "qsa_prefill_rows",
    "qsa_shard_positions",
    "qsa_shard_token_indices",
    "qsa_topk_blocks_local",
    "qsa_topk_blocks_sharded",
    "qsa_topk_merge",
    "xattn_block_sparse_shard",
    "xattn_block_sparse_sharded",
    "xattn_prefill_context_parallel",
    "xattn_prefill_rows",
    "zigzag_ranges",
]


# --------------------------------------------------------------------------------------------
# Helpers


def _index(value, name, minimum=0):
    """A Python int >= minimum (ints, numpy and 0-d integer tensors), else TypeError/ValueError
    naming the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__qualname__}") from None
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _require_tensor(value, name):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__qualname__}")


def _all_gather_flat(buffer, group):
    """All-gathers a contiguous 1-D buffer: returns [world, buffer.numel()], rank order."""
    world = dist.get_world_size(group)
    gathered = torch.empty((world * buffer.numel(),), dtype=buffer.dtype, device=buffer.device)
    if dist.get_backend(group) in ("nccl", "gloo"):
        dist.all_gather_into_tensor(gathered, buffer, group=group)
    else:
        dist.all_gather(list(gathered.chunk(world)), buffer, group=group)
    return gathered.view(world, buffer.numel())


# --------------------------------------------------------------------------------------------
# QSA: top-k over sharded indexer scores


def qsa_topk_blocks_local(local_scores, k=QSA_TOPK_BLOCKS, *, block_offset):
    """One rank's candidates for the global top-k: the `k` best blocks of its own scores
    (``qsa_topk_blocks``: score descending, ties to the lower id, -1 padding), as global ids
    (local id + block_offset) with their scores. local_scores: FP32 [rows, local_blocks] or
    [B, Q, local_blocks], the indexer scores of the shard's compressed blocks
    block_offset .. block_offset + local_blocks - 1. Returns (ids int32, scores FP32), both
    local_scores.shape[:-1] + (k,); padding entries are id -1 with score -inf."""
    _require_tensor(local_scores, "local_scores")
    block_offset = _index(block_offset, "block_offset")
    k = _index(k, "k", 1)
    local_blocks = local_scores.shape[-1]
    if block_offset + local_blocks > 2**31 - 1:
        raise ValueError(f"block_offset: block ids are int32; block_offset + local blocks = "
                         f"{block_offset + local_blocks} does not fit")
    ids = qsa_topk_blocks(local_scores, k)
    valid = ids >= 0
    if local_blocks:
        scores = torch.gather(local_scores, -1, ids.clamp(min=0).long())
    else:
        scores = torch.empty(ids.shape, dtype=torch.float32, device=ids.device)
    scores = torch.where(valid, scores, -math.inf)
    ids = torch.where(valid, ids + block_offset, -1).to(torch.int32)
    return ids, scores


def qsa_topk_merge(ids, scores, k=QSA_TOPK_BLOCKS, *, out=None):
    """Merges the ranks' candidates ([N, ..., c] ids and scores, rank-major as gathered) into
    the global top-k: the order of ``qsa_topk_blocks`` (score descending, equal scores by
    ascending id, -0 equal to +0), padding (id -1 / score -inf) last and written as -1.
    Returns int32 [..., k] (exactly `out` when given)."""
    _require_tensor(ids, "ids")
    _require_tensor(scores, "scores")
    k = _index(k, "k", 1)
    if ids.shape != scores.shape or ids.dim() < 2:
        raise ValueError(f"ids, scores: expected the same shape [N, ..., c], got "
                         f"{tuple(ids.shape)} and {tuple(scores.shape)}")
    lead = ids.shape[1:-1]
    ids = ids.movedim(0, -2).reshape(*lead, -1)
    scores = scores.movedim(0, -2).reshape(*lead, -1).float() + 0.0  # -0 -> +0
    pad = scores == -math.inf
    ids = torch.where(pad, torch.iinfo(torch.int32).max, ids.to(torch.int32))
    # Ascending id first, then a stable sort by descending score: equal scores keep the
    # ascending id order (the library's tie rule). Ids never repeat (the shards are disjoint).
    by_id = torch.sort(ids, dim=-1, stable=True)
    scores = torch.gather(scores, -1, by_id.indices)
    by_score = torch.sort(scores, dim=-1, descending=True, stable=True)
    width = min(k, ids.shape[-1])
    chosen = torch.gather(by_id.values, -1, by_score.indices[..., :width])
    chosen = torch.where(by_score.values[..., :width] == -math.inf, -1, chosen)
    if width < k:
        chosen = torch.cat([chosen, chosen.new_full((*lead, k - width), -1)], dim=-1)
    chosen = chosen.to(torch.int32)
    if out is None:
        return chosen
    out.copy_(chosen)
    return out


def qsa_topk_blocks_sharded(local_scores, k=QSA_TOPK_BLOCKS, *, block_offset, group=None,
                            out=None):
    """The global ``qsa_topk_blocks(scores, k)`` of scores whose block axis is sharded over
    the group: rank r passes the FP32 scores of its compressed blocks
    block_offset .. block_offset + local_scores.shape[-1] - 1 ([rows, local_blocks] or
    [B, Q, local_blocks], the same rows on every rank). Returns the same int32 global ids, in
    the same order, as ``qsa_topk_blocks`` on the scores concatenated in block order would
    (the shards must be disjoint; they need not be in rank order or of equal width). One
    all_gather of rows * k * 8 bytes per rank."""
    ids, scores = qsa_topk_blocks_local(local_scores, k, block_offset=block_offset)
    packed = torch.stack([ids, scores.view(torch.int32)]).reshape(-1)
    gathered = _all_gather_flat(packed, group).view(-1, 2, *ids.shape)
    return qsa_topk_merge(gathered[:, 0], gathered[:, 1].view(torch.float32), k, out=out)


# --------------------------------------------------------------------------------------------
# Partial attention states: gather and merge


def all_gather_states(partial_out, partial_lse, group=None):
    """Gathers every rank's partial (out, lse) in one all_gather (the two packed into one byte
    buffer): returns ([N, *out.shape], [N, *lse.shape]) in rank order. out of any float dtype,
    lse FP32; rows * heads * (D * out.element_size() + 4) bytes per rank."""
    _require_tensor(partial_out, "partial_out")
    _require_tensor(partial_lse, "partial_lse")
    out_bytes = partial_out.numel() * partial_out.element_size()
    lse_offset = (out_bytes + 15) // 16 * 16  # the lse part aligned, for its float view
    total = lse_offset + partial_lse.numel() * 4
    total = (total + 15) // 16 * 16
    packed = torch.zeros((total,), dtype=torch.uint8, device=partial_out.device)
    packed[:out_bytes] = partial_out.contiguous().view(-1).view(torch.uint8)
    packed[lse_offset:lse_offset + partial_lse.numel() * 4] = \
        partial_lse.float().contiguous().view(-1).view(torch.uint8)
    gathered = _all_gather_flat(packed, group)
    world = gathered.shape[0]
    outs = gathered[:, :out_bytes].view(partial_out.dtype).view(world, *partial_out.shape)
    lses = gathered[:, lse_offset:lse_offset + partial_lse.numel() * 4].view(torch.float32)
    return outs, lses.view(world, *partial_lse.shape)


def _gather_or_poison(partial, like, group):
    """The gather of the sharded attention functions: `partial` is this rank's (out, lse), or
    the error its per-shard call raised. A rank that failed still takes part, with a NaN LSE
    shaped like the query `like` (which every rank passes the same), then raises its error:
    no rank is left waiting in the gather, and the merge turns every row of the other ranks'
    results into NaN (merge_attention_states' rule for a NaN LSE) rather than a quietly wrong
    one. Telling the other ranks to raise would need a host synchronisation every step, which
    CUDA graph capture forbids."""
    if not isinstance(partial, Exception):
        return all_gather_states(*partial, group)
    part_out = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    part_lse = torch.full(like.shape[:-1], math.nan, dtype=torch.float32, device=like.device)
    all_gather_states(part_out, part_lse, group)
    raise partial


def _sigmoid_fp32(gate):
    # docs/qsa.md, "Gate": sigmoid(gate) = 1 / (1 + exp(-gate)) in FP32.
    g = gate.float()
    return 1.0 / (1.0 + torch.exp(-g))


def merge_shard_states(partial_out, partial_lse, *, gate=None, out=None, lse=None,
                       return_lse=True, backend="native"):
    """Merges the partials of N shards: partial_out [N, *rows, H, D], partial_lse FP32
    [N, *rows, H] (natural log; -inf for a shard that saw no token of a row) through
    ``sparse_attn.merge_attention_states`` in shard order. With `gate` (the query's shape, or
    without its last axis: one factor per head) the merged output is then gated as
    ``qsa_sparse_attention`` gates its own: rounded to the output dtype, times
    sigmoid(gate) = 1 / (1 + exp(-gate)) in FP32, rounded again. Returns (out, lse) (out only
    when return_lse is False); out= / lse= are written and returned."""
    _require_tensor(partial_out, "partial_out")
    _require_tensor(partial_lse, "partial_lse")
    if partial_out.dim() < 3 or tuple(partial_lse.shape) != tuple(partial_out.shape[:-1]):
        raise ValueError(f"partial_out, partial_lse: expected [N, ..., H, D] and [N, ..., H], "
                         f"got {tuple(partial_out.shape)} and {tuple(partial_lse.shape)}")
    n = partial_out.shape[0]
    shape = tuple(partial_out.shape[1:])
    heads, dim = shape[-2], shape[-1]
    po = partial_out.reshape(n, -1, heads, dim)
    pl = partial_lse.reshape(n, -1, heads)
    # Without a gate, contiguous destinations are the merge's own outputs (no copy).
    direct_out = out if gate is None and out is not None and out.is_contiguous() \
        and tuple(out.shape) == shape else None
    direct_lse = lse if lse is not None and lse.is_contiguous() \
        and tuple(lse.shape) == shape[:-1] else None
    merged, merged_lse = merge_attention_states(
        po, pl, return_lse=True, backend=backend,
        out=None if direct_out is None else direct_out.view(-1, heads, dim),
        lse_out=None if direct_lse is None else direct_lse.view(-1, heads))
    merged = merged.view(shape) if direct_out is None else direct_out
    merged_lse = merged_lse.view(shape[:-1]) if direct_lse is None else direct_lse
    if gate is not None:
        _require_tensor(gate, "gate")
        factor = _sigmoid_fp32(gate)
        if tuple(gate.shape) == shape[:-1]:
            factor = factor.unsqueeze(-1)
        elif tuple(gate.shape) != shape:
            raise ValueError(f"gate: expected shape {list(shape)} or {list(shape[:-1])}, got "
                             f"{list(gate.shape)}")
        merged = (merged.float() * factor).to(merged.dtype)
    if out is not None and merged is not out:
        out.copy_(merged)
        merged = out
    if lse is not None and merged_lse is not lse:
        lse.copy_(merged_lse)
        merged_lse = lse
    return (merged, merged_lse) if return_lse else merged


# --------------------------------------------------------------------------------------------
# QSA: sparse attention over a sharded K/V cache


def qsa_shard_token_indices(token_indices, shard_start, shard_len):
    """Global token ids -> the shard's local ids: t - shard_start for t in
    [shard_start, shard_start + shard_len), -1 for every other id (padding included). Same
    shape and dtype."""
    _require_tensor(token_indices, "token_indices")
    shard_start = _index(shard_start, "shard_start")
    shard_len = _index(shard_len, "shard_len")
    inside = (token_indices >= shard_start) & (token_indices < shard_start + shard_len)
    return torch.where(inside, token_indices - shard_start, -1).to(token_indices.dtype)


def qsa_shard_positions(query_positions, shard_start):
    """Global query positions -> positions in the shard's coordinates (p - shard_start), so
    that the op's causal rule t_local <= p_local is t <= p. A row before the shard comes out
    negative: a padding row for the shard (it sees none of its tokens: zero output, LSE -inf),
    as global padding rows stay."""
    _require_tensor(query_positions, "query_positions")
    shard_start = _index(shard_start, "shard_start")
    return (query_positions - shard_start).to(query_positions.dtype)


_SHARD_REFUSED = {
    "selected_kv_indices": "physical-mode ids have no positions to shard by; use token_indices",
    "return_lse": "the per-shard call always returns (out, lse)",
}


def qsa_sparse_attention_shard(query, key_shard, value_shard, token_indices, *, shard_start,
                               shard_len, query_positions=None, seq_lens_k=None,
                               **attention_kwargs):
    """One rank's partial of ``qsa_sparse_attention`` when the request's K/V is sharded by
    sequence: key_shard / value_shard hold the tokens shard_start .. shard_start + shard_len - 1
    of every request (in any layout the op takes: padded [B, S_shard, Hkv, D], paged with the
    shard's own block_table, flattened with the shard's own cu_seqlens_k). Global coordinates
    in, local to the call: token_indices (global ids, -1 pads) keep the ids inside the shard,
    shifted; query_positions (required: the default positions follow from the global KV
    length, which a shard does not know) are shifted by -shard_start; seq_lens_k, when given,
    is the global KV length per request and becomes clamp(seq_lens_k - shard_start, 0,
    shard_len). The other keywords are the op's, passed as they are (the shard's layout:
    block_table, page_size, cu_seqlens_k; the query rows': cu_seqlens_q, token_to_req,
    num_requests, seq_lens_q; scale, backend, ...). The gate is not taken here: it applies
    once, after the merge (merge_shard_states). block_indices (a hint that never changes the
    result) is dropped; the shard runs the token path. Returns (out, lse) of the query's shape
    (lse FP32 without the last axis; -inf, out 0, where the shard holds no selected token)."""
    _require_tensor(query, "query")
    shard_start = _index(shard_start, "shard_start")
    shard_len = _index(shard_len, "shard_len")
    for name, why in _SHARD_REFUSED.items():
        if attention_kwargs.get(name) is not None:
            raise NotSupportedError(f"{name}: not taken by the sharded attention ({why})")
    if attention_kwargs.get("gate") is not None:
        raise ValueError("gate: the gate applies once, after the shards are merged; pass it to "
                         "qsa_sparse_attention_sharded or merge_shard_states")
    attention_kwargs.pop("gate", None)
    attention_kwargs.pop("block_indices", None)
    attention_kwargs.pop("assume_compact_blocks", None)  # filtered ids are not compact
    if query_positions is None:
        raise ValueError("query_positions: required by the sharded attention (the default "
                         "positions follow from the global KV length, which a shard does not "
                         "know); pass every query row's request-local position")
    local_ids = qsa_shard_token_indices(token_indices, shard_start, shard_len)
    local_positions = qsa_shard_positions(query_positions, shard_start)
    if seq_lens_k is not None:
        _require_tensor(seq_lens_k, "seq_lens_k")
        seq_lens_k = (seq_lens_k - shard_start).clamp(0, shard_len).to(seq_lens_k.dtype)
    return qsa_sparse_attention(query, key_shard, value_shard, local_ids,
                                query_positions=local_positions, seq_lens_k=seq_lens_k,
                                return_lse=True, **attention_kwargs)


def qsa_sparse_attention_sharded(query, key_shard, value_shard, token_indices, *, shard_start,
                                 shard_len, group=None, gate=None, return_lse=False, out=None,
                                 lse=None, merge_backend="native", **attention_kwargs):
    """``qsa_sparse_attention`` of a request whose K/V is sharded by sequence over the group:
    every rank passes the same query rows, token_indices (global ids), query_positions (global,
    required) and gate, and its own shard (tokens shard_start .. shard_start + shard_len - 1,
    see qsa_sparse_attention_shard for the keywords). Each rank attends to its share, the
    partials are all-gathered (one buffer: rows * Hq * (D * 2 + 4) bytes per rank for 16-bit
    queries) and merged through their LSE in rank order, then gated once. Every rank returns
    the same result: the output (exactly out= when given), or (out, lse) when return_lse;
    decode and prefill rows alike. Rows none of whose tokens any rank holds give 0 and -inf."""
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__qualname__}")
    if gate is not None:
        _require_tensor(gate, "gate")
    _require_tensor(query, "query")
    try:
        partial = qsa_sparse_attention_shard(
            query, key_shard, value_shard, token_indices, shard_start=shard_start,
            shard_len=shard_len, **attention_kwargs)
    except (ValueError, TypeError) as e:  # NotSupportedError is a ValueError
        partial = e
    outs, lses = _gather_or_poison(partial, query, group)
    return merge_shard_states(outs, lses, gate=gate, out=out, lse=lse, return_lse=return_lse,
                              backend=merge_backend)


# --------------------------------------------------------------------------------------------
# XAttention: block-sparse attention over K/V sharded by 128-token blocks


def _cdiv(a, b):
    return -(-a // b)


def _full_block_mask(base_blockmask, head_mask_type, streaming_info, heads, q_len, k_len,
                     is_causal, device):
    """Every head as a block-sparse (type 1) head: [1, heads, q_blocks, k_blocks] bool. Dense
    heads (0) keep every block, streaming heads (-1) their window by docs/xattention.md's rule
    (j < sink or d - local < j <= d, d the diagonal block when causal, the last block
    otherwise), block-sparse heads (1) their base_blockmask row."""
    qb, kb = _cdiv(q_len, BLOCK), _cdiv(k_len, BLOCK)
    types = [1] * heads if head_mask_type is None else [int(t) for t in head_mask_type]
    if len(types) != heads:
        raise ValueError(f"head_mask_type: expected {heads} entries (one per query head), got "
                         f"{len(types)}")
    if any(t not in (-1, 0, 1) for t in types):
        raise ValueError(f"head_mask_type: expected entries -1, 0 or 1, got {types}")
    sparse = sum(1 for t in types if t == 1)
    if sparse:
        _require_tensor(base_blockmask, "base_blockmask")
        if tuple(base_blockmask.shape) != (1, sparse, qb, kb):
            raise ValueError(f"base_blockmask: expected shape [1, {sparse}, {qb}, {kb}] "
                             f"(one sequence, the block-sparse heads, ceil(Lq / 128), "
                             f"ceil(k_len / 128)), got {list(base_blockmask.shape)}")
        if base_blockmask.dtype != torch.bool:
            raise TypeError(f"base_blockmask: expected dtype bool, got {base_blockmask.dtype}")
    if head_mask_type is None:
        return base_blockmask.to(device)
    stream = None
    if -1 in types:
        if streaming_info is None:
            raise ValueError("streaming_info: required with streaming heads (head_mask_type -1)")
        stream = [int(x) for x in streaming_info]
        if len(stream) < 2 * heads:
            raise ValueError(f"streaming_info: expected {2 * heads} entries (sink, local per "
                             f"head), got {len(stream)}")
        i = torch.arange(qb, device=device)
        if is_causal:
            last_row = torch.clamp(BLOCK * i + BLOCK - 1, max=q_len - 1)
            diag = torch.div(k_len - q_len + last_row, BLOCK, rounding_mode="floor")
        else:
            diag = torch.full((qb,), kb - 1, device=device)
        j = torch.arange(kb, device=device)
    full = torch.empty((1, heads, qb, kb), dtype=torch.bool, device=device)
    s = 0
    for h, t in enumerate(types):
        if t == 1:
            full[0, h] = base_blockmask[0, s].to(device)
            s += 1
        elif t == 0:
            full[0, h] = True
        else:
            sink, local = stream[2 * h], stream[2 * h + 1]
            d = diag[:, None]
            full[0, h] = (j[None, :] < sink) | ((j[None, :] > d - local) & (j[None, :] <= d))
    return full


def xattn_block_sparse_shard(q, k_shard, v_shard, base_blockmask, *, k_len, block_start,
                             head_mask_type=None, streaming_info=None, softmax_scale=None,
                             is_causal=True, backend="native"):
    """One rank's partial of ``block_sparse_attn_func`` for one sequence whose keys are sharded
    by 128-token blocks: q [Lq, Hq, D] (every query row, the same on every rank), k_shard /
    v_shard [n, Hkv, D] the keys 128 * block_start .. 128 * block_start + n - 1 of a sequence of
    k_len keys (n a multiple of 128 unless the shard ends the sequence), base_blockmask the
    global mask [1, sparse_heads, ceil(Lq / 128), ceil(k_len / 128)] (bool) for
    head_mask_type / streaming_info as block_sparse_attn_func takes them. The causal rule stays
    the global one (bottom-right on Lq and k_len): the rows whose causal limit falls inside the
    shard run causally against it, the rows that see all of it without the causal mask (two
    calls at most; the second recomputes < 128 rows of a query block it shares with the first).
    Returns (out [Lq, Hq, D], lse FP32 [Lq, Hq]); rows that see nothing of the shard get 0 and
    -inf."""
    for value, name in ((q, "q"), (k_shard, "k_shard"), (v_shard, "v_shard")):
        _require_tensor(value, name)
    if q.dim() != 3 or k_shard.dim() != 3:
        raise ValueError(f"q, k_shard: expected [Lq, Hq, D] and [n, Hkv, D] (one sequence), got "
                         f"{list(q.shape)} and {list(k_shard.shape)}")
    k_len = _index(k_len, "k_len")
    block_start = _index(block_start, "block_start")
    q_len, heads = q.shape[0], q.shape[1]
    n = k_shard.shape[0]
    offset = BLOCK * block_start
    if n and offset + n > k_len:
        raise ValueError(f"k_shard: the shard's keys {offset} .. {offset + n - 1} reach past "
                         f"k_len = {k_len}")
    if n % BLOCK and offset + n != k_len:
        raise ValueError(f"k_shard: expected a multiple of {BLOCK} keys unless the shard ends "
                         f"the sequence (k_len = {k_len}), got {n} keys from key {offset}")
    full = _full_block_mask(base_blockmask, head_mask_type, streaming_info, heads, q_len, k_len,
                            is_causal, q.device)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q_len, heads), -math.inf, dtype=torch.float32, device=q.device)
    if n == 0 or q_len == 0:
        return out, lse
    local = full[..., block_start:block_start + _cdiv(n, BLOCK)]

    def attend(rows_from, rows_to, causal, dst_out, dst_lse):
        rows = rows_to - rows_from
        cu_q = torch.tensor([0, rows], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        mask = local[:, :, rows_from // BLOCK:_cdiv(rows_to, BLOCK)].contiguous()
        block_sparse_attn_func(q[rows_from:rows_to], k_shard, v_shard, cu_q, cu_k, None, None,
                               mask, rows, n, 0.0, softmax_scale=softmax_scale,
                               is_causal=causal, backend=backend, out=dst_out, lse=dst_lse)

    if not is_causal:
        attend(0, q_len, False, out, lse)
        return out, lse
    # Row r sits at pos(r) = k_len - q_len + r and sees keys up to pos(r) - offset of the
    # shard. The call's bottom-right rule over `a` rows and the shard's n keys gives
    # n - a + r: equal when a = q_len - after, after the keys past the shard. Rows from `a`
    # on see the whole shard (pos(r) - offset >= n): no causal mask.
    after = k_len - offset - n
    a = min(max(q_len - after, 0), q_len)
    if a:
        attend(0, a, True, out[:a], lse[:a])
    if a < q_len:
        start = a // BLOCK * BLOCK  # the second call starts on a query block boundary
        tail_out = torch.empty((q_len - start, heads, q.shape[2]), dtype=q.dtype,
                               device=q.device)
        tail_lse = torch.empty((q_len - start, heads), dtype=torch.float32, device=q.device)
        attend(start, q_len, False, tail_out, tail_lse)
        out[a:] = tail_out[a - start:]
        lse[a:] = tail_lse[a - start:]
    return out, lse


def xattn_block_sparse_sharded(q, k_shard, v_shard, base_blockmask, *, k_len, block_start,
                               head_mask_type=None, streaming_info=None, softmax_scale=None,
                               is_causal=True, group=None, backend="native", return_lse=False,
                               out=None, lse=None, merge_backend="native"):
    """``block_sparse_attn_func`` for one sequence of k_len keys sharded by 128-token blocks
    over the group: rank r holds keys 128 * block_start .. 128 * block_start + n - 1 (see
    xattn_block_sparse_shard); q, base_blockmask, head_mask_type and streaming_info are the
    same on every rank. Each rank attends to its blocks (the mask restricted to them), the
    partials are all-gathered and merged through their LSE in rank order. Returns
    out [Lq, Hq, D] (exactly out= when given), or (out, lse) when return_lse."""
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__qualname__}")
    _require_tensor(q, "q")
    try:
        partial = xattn_block_sparse_shard(
            q, k_shard, v_shard, base_blockmask, k_len=k_len, block_start=block_start,
            head_mask_type=head_mask_type, streaming_info=streaming_info,
            softmax_scale=softmax_scale, is_causal=is_causal, backend=backend)
    except (ValueError, TypeError) as e:  # NotSupportedError is a ValueError
        partial = e
    outs, lses = _gather_or_poison(partial, q, group)
    return merge_shard_states(outs, lses, out=out, lse=lse, return_lse=return_lse,
                              backend=merge_backend)


# --------------------------------------------------------------------------------------------
# Prefill: query rows sharded with the sequence, K/V all-gathered (docs/distributed.md,
# "Context-parallel prefill")


def zigzag_ranges(total, world, *, align=1):
    """The load-balanced split of a causal prefill of `total` tokens over `world` ranks: the
    sequence in 2 * world chunks of equal size (a multiple of `align`; the last chunks take
    what is left, and may be short or empty), rank r holding chunks r and 2 * world - 1 - r.
    Under a causal mask chunk i's rows see i + 1/2 chunks of keys on average, so every rank's
    two chunks see the same: the work of each rank is total^2 / (2 world) key-row pairs.
    Returns a list over ranks of [(start, len), (start, len)], the same on every rank."""
    total = _index(total, "total")
    world = _index(world, "world", 1)
    align = _index(align, "align", 1)
    chunk = _cdiv(_cdiv(total, 2 * world), align) * align

    def piece(i):
        start = min(i * chunk, total)
        return (start, min(start + chunk, total) - start)

    return [[piece(r), piece(2 * world - 1 - r)] for r in range(world)]


def _parse_ranges(own, name):
    """One rank's list of (start, len) as int pairs."""
    if not isinstance(own, (list, tuple)):
        raise TypeError(f"{name}: expected a list of (start, len), got {type(own).__qualname__}")
    pairs = []
    for piece in own:
        if not isinstance(piece, (list, tuple)) or len(piece) != 2:
            raise ValueError(f"{name}: expected (start, len) pairs, got {piece!r}")
        pairs.append((_index(piece[0], f"{name} start"), _index(piece[1], f"{name} len")))
    return pairs


def _check_ranges(ranges, world, name="ranges"):
    """ranges: one list of (start, len) per rank, disjoint, together [0, total). Returns them
    as lists of int pairs, and total."""
    if not isinstance(ranges, (list, tuple)) or len(ranges) != world:
        raise ValueError(f"{name}: expected one list of (start, len) per rank ({world} ranks), "
                         f"got {ranges!r}")
    checked = [_parse_ranges(own, f"{name}[{r}]") for r, own in enumerate(ranges)]
    end = 0
    for start, length in sorted(p for own in checked for p in own if p[1]):
        if start != end:
            raise ValueError(f"{name}: expected disjoint ranges that cover 0 .. total - 1 "
                             f"together; {'tokens overlap' if start < end else 'a gap'} at "
                             f"{min(start, end)}")
        end = start + length
    return checked, end


def _range_rows(own):
    """Rows of one rank's ranges."""
    return sum(length for _, length in own)


def _row_bytes(t, dim):
    n = t.element_size()
    for d, size in enumerate(t.shape):
        if d != dim:
            n *= size
    return n


_MAX_DIMS = 8
# What a rank found wrong with an item before the gather (the header's second entry).
_PROBLEMS = {1: "not a tensor", 2: f"fewer axes than its sequence axis, or more than {_MAX_DIMS}",
             3: "not as many rows along its sequence axis as its ranges hold"}


def _signature(local, dim):
    """An item's dtype and shape but its sequence axis, as the header's _MAX_DIMS + 2 ints."""
    sizes = [-1 if d == dim else size for d, size in enumerate(local.shape)]
    return [zlib.crc32(str(local.dtype).encode()), local.dim(),
            *sizes, *[0] * (_MAX_DIMS - len(sizes))]


def _buffer_device(items, group):
    for _, local, _, _ in items:
        if isinstance(local, torch.Tensor):
            return local.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_on_items(items, rank, world, group, device):
    """Every rank's check of its items, shared before the data moves (one small all_gather),
    so that a malformed item on one rank makes every rank raise instead of leaving the others
    in a collective of another size: the rank that found it raises its own error, the others a
    ValueError naming the item and the rank. Items whose dtype or shape (but the sequence
    axis) differ across ranks, and ranks that passed different ranges, raise on every rank
    too."""
    error, status, signatures = None, [-1, 0], []
    for i, (name, local, ranges, dim) in enumerate(items):
        rows = _range_rows(ranges[rank])
        try:
            _require_tensor(local, name)
            if local.dim() <= dim or local.dim() > _MAX_DIMS:
                status = [i, 2]
                raise ValueError(f"{name}: expected an axis {dim} (its sequence axis) and at most "
                                 f"{_MAX_DIMS} axes, got shape {list(local.shape)}")
            if local.shape[dim] != rows:
                status = [i, 3]
                raise ValueError(f"{name}: expected {rows} rows along dim {dim} (this rank's "
                                 f"ranges {ranges[rank]}), got {local.shape[dim]}")
        except (TypeError, ValueError) as e:
            error = e
            if status[0] < 0:
                status = [i, 1]
            break
    for _, local, _, dim in items:
        signatures += [0] * (_MAX_DIMS + 2) if error else _signature(local, dim)
    layout = zlib.crc32(repr([ranges for _, _, ranges, _ in items]).encode())
    header = torch.tensor(status + [layout] + signatures, dtype=torch.int64, device=device)
    headers = _all_gather_flat(header, group).cpu()
    if error is not None:
        raise error
    for r in range(world):
        item, problem = int(headers[r, 0]), int(headers[r, 1])
        if item >= 0:
            raise ValueError(f"{items[item][0]}: rank {r}'s is {_PROBLEMS[problem]} (that rank "
                             f"raised the details)")
    if not all(int(headers[r, 2]) == layout for r in range(world)):
        raise ValueError("ranges: expected the same ranges on every rank (they say where every "
                         "rank's rows go); the ranks passed different ones")
    width = _MAX_DIMS + 2
    for i, (name, local, _, dim) in enumerate(items):
        mine = headers[rank, 3 + i * width:3 + (i + 1) * width]
        for r in range(world):
            if not torch.equal(headers[r, 3 + i * width:3 + (i + 1) * width], mine):
                raise ValueError(f"{name}: expected the same dtype and shape (but axis {dim}) on "
                                 f"every rank; rank {r}'s differs from rank {rank}'s "
                                 f"({local.dtype}, {list(local.shape)})")


def _gather_sequences(items, rank, world, group):
    """One all_gather for several sequence-sharded tensors. items: (name, local, ranges, dim),
    local holding this rank's rows of ranges[rank] along dim (in that order); every rank passes
    the same dtypes and shapes but for dim (checked first, _agree_on_items). Returns each tensor
    whole (the ranges' total rows along dim, in sequence order)."""
    device = _buffer_device(items, group)
    _agree_on_items(items, rank, world, group, device)
    # Byte offsets of rank r's items in its buffer (16-byte aligned), and the buffer's size.
    offsets = []
    for r in range(world):
        at, mine = 0, []
        for _, local, ranges, dim in items:
            mine.append(at)
            at += (_range_rows(ranges[r]) * _row_bytes(local, dim) + 15) // 16 * 16
        offsets.append((mine, at))
    size = max(at for _, at in offsets)
    packed = torch.zeros((size,), dtype=torch.uint8, device=device)
    for (_, local, _, dim), at in zip(items, offsets[rank][0]):
        data = local.movedim(dim, 0).contiguous().view(-1).view(torch.uint8)
        packed[at:at + data.numel()] = data
    gathered = _all_gather_flat(packed, group)
    wholes = []
    for i, (_, local, ranges, dim) in enumerate(items):
        shape = list(local.shape)
        shape[dim] = sum(_range_rows(own) for own in ranges)
        whole = torch.empty(shape, dtype=local.dtype, device=local.device)
        rest = shape[:dim] + shape[dim + 1:]
        for r in range(world):
            n = _range_rows(ranges[r])
            at = offsets[r][0][i]
            src = gathered[r, at:at + n * _row_bytes(local, dim)].view(local.dtype)
            src = src.view(n, *rest)
            row = 0
            for start, length in ranges[r]:
                whole.narrow(dim, start, length).copy_(src[row:row + length].movedim(0, dim))
                row += length
        wholes.append(whole)
    return wholes


def all_gather_sequence(local, ranges, *, dim=0, group=None):
    """A tensor sharded by sequence over the group, whole on every rank: rank r's `local`
    holds the rows ranges[r] (a list of (start, len), concatenated in that order) along `dim`;
    ranges (one list per rank, the same on every rank, e.g. zigzag_ranges) are disjoint and
    cover 0 .. total - 1. Every rank passes the same shape but for dim, and the same dtype.
    Returns the tensor with `total` rows along dim, in sequence order. One all_gather of
    max-rank rows x row bytes per rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranges, _ = _check_ranges(ranges, world)
    dim = _index(dim, "dim")
    return _gather_sequences([("local", local, ranges, dim)], rank, world, group)[0]


def _positions(own, device):
    return torch.cat([torch.arange(s, s + n, dtype=torch.int32, device=device) for s, n in own]
                     or [torch.empty((0,), dtype=torch.int32, device=device)])


def _check_granularity(ranges, total, step, what):
    for r, own in enumerate(ranges):
        for start, length in own:
            if length and (start % step or (length % step and start + length != total)):
                raise ValueError(f"ranges[{r}]: expected starts and lengths that are multiples "
                                 f"of {step} ({what}; only the range that ends the sequence "
                                 f"may end inside one), got ({start}, {length})")


def qsa_prefill_rows(query, q_idx, key, value, block_keys, *, ranges, topk=QSA_TOPK_BLOCKS,
                     gate=None, return_lse=False, indexer_options=None, **attention_kwargs):
    """The per-rank piece of qsa_prefill_context_parallel, without a process group: the rows
    of `ranges` (one rank's list of (start, len), its query [n, Hq, D], q_idx [n, H_idx, D_idx]
    and gate [n, Hq(, D)] in that order) against the whole key / value [T, Hkv, D] and
    block_keys [T // 4, D_idx]: qsa_indexer_select at each row's position (topk blocks
    expanded to tokens; indexer_options its keywords), then qsa_sparse_attention (the other
    keywords) with the selected blocks as its block hint (topk <= 512). Returns out [n, Hq, D]
    (and lse FP32 [n, Hq] with return_lse)."""
    for value_, name in ((query, "query"), (key, "key"), (value, "value"), (q_idx, "q_idx"),
                         (block_keys, "block_keys")):
        _require_tensor(value_, name)
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__qualname__}")
    for name in ("query_positions", "token_indices", "selected_kv_indices", "block_indices",
                 "assume_compact_blocks"):
        if attention_kwargs.get(name) is not None:
            raise ValueError(f"{name}: set by the context-parallel prefill (each rank's rows "
                             f"are at their ranges' positions and select their own tokens)")
    own = _parse_ranges(ranges, "ranges")
    positions = _positions(own, query.device)[None]
    ids, tokens = qsa_indexer_select(q_idx[None], block_keys[None], topk,
                                     query_positions=positions, return_tokens=True,
                                     **(indexer_options or {}))
    # The selected blocks are visible ones, ids first and -1 after: they are the attention's
    # block hint as they stand, up to the hint's widest selection.
    hinted = _index(topk, "topk", 1) <= _HINT_MAX_BLOCKS
    result = qsa_sparse_attention(query[None], key[None], value[None], tokens,
                                  query_positions=positions,
                                  block_indices=ids if hinted else None,
                                  assume_compact_blocks=hinted,
                                  gate=None if gate is None else gate[None],
                                  return_lse=return_lse, **attention_kwargs)
    if return_lse:
        return result[0][0], result[1][0]
    return result[0]


def qsa_prefill_context_parallel(query, key, value, q_idx, block_keys, *, ranges,
                                 topk=QSA_TOPK_BLOCKS, group=None, gate=None, return_lse=False,
                                 indexer_options=None, **attention_kwargs):
    """QSA's prefill of one request whose tokens are sharded over the group, query rows with
    them: rank r holds the tokens ranges[r] (a list of (start, len), e.g. zigzag_ranges(T,
    world, align=4)), and for them query [n, Hq, D], key / value [n, Hkv, D], the indexer's
    q_idx [n, H_idx, D_idx] and block_keys [n_blocks, D_idx], the compressed keys of the
    complete 4-token blocks of its ranges (qsa_compress_block_keys of its raw index keys;
    starts multiples of 4, lengths too unless a range ends the sequence). One all_gather
    makes K, V and the block keys whole on every rank (2 Hkv D + D_idx / 4 elements a token);
    then the rank selects for and attends to its own rows (qsa_prefill_rows: gate
    [n, Hq(, D)], indexer_options, the attention's keywords). Nothing is merged: each rank's
    rows are whole. Returns the rank's out [n, Hq, D] (and lse FP32 [n, Hq] with return_lse),
    row for row what the single-process pipeline gives those rows."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranges, total = _check_ranges(ranges, world)
    _check_granularity(ranges, total, 4, "whole indexer blocks")
    blocks = [[(s // 4, n // 4) for s, n in own] for own in ranges]
    k_all, v_all, keys_all = _gather_sequences(
        [("key", key, ranges, 0), ("value", value, ranges, 0),
         ("block_keys", block_keys, blocks, 0)], rank, world, group)
    return qsa_prefill_rows(query, q_idx, k_all, v_all, keys_all, ranges=ranges[rank],
                            topk=topk, gate=gate, return_lse=return_lse,
                            indexer_options=indexer_options, **attention_kwargs)


def xattn_prefill_rows(query_states, key_states, value_states, stride, *, ranges,
                       **prefill_kwargs):
    """The per-rank piece of xattn_prefill_context_parallel, without a process group: the rows
    of `ranges` (one rank's list of (start, len); its query_states [B, Hq, n, D] in that order)
    against the whole key / value_states [B, Hkv, T, D], each range a prefill chunk against
    the keys up to its end (Xattention_prefill, causal, with prefill_kwargs). Returns
    out [B, Hq, n, D]."""
    for value_, name in ((query_states, "query_states"), (key_states, "key_states"),
                         (value_states, "value_states")):
        _require_tensor(value_, name)
    for name in ("out", "lse"):
        if prefill_kwargs.get(name) is not None:
            raise NotSupportedError(f"{name}: not taken by the context-parallel prefill")
    if prefill_kwargs.get("causal", True) is not True:
        raise ValueError("causal: the context-parallel prefill is causal (each rank's rows see "
                         "the keys up to their own)")
    outs, row = [], 0
    for start, length in _parse_ranges(ranges, "ranges"):
        if length == 0:
            continue
        end = start + length
        outs.append(Xattention_prefill(query_states[:, :, row:row + length],
                                       key_states[:, :, :end], value_states[:, :, :end], stride,
                                       **prefill_kwargs))
        row += length
    if not outs:
        return torch.empty_like(query_states)
    return torch.cat(outs, dim=2)


def xattn_prefill_context_parallel(query_states, key_states, value_states, stride, *, ranges,
                                   group=None, **prefill_kwargs):
    """Xattention_prefill (causal) of one sequence whose tokens are sharded over the group,
    query rows with them: rank r holds the tokens ranges[r] (a list of (start, len), e.g.
    zigzag_ranges(T, world, align=128); starts and lengths multiples of the block size unless
    a range ends the sequence) and for them query_states [B, Hq, n, D], key / value_states
    [B, Hkv, n, D]. One all_gather makes K and V whole on every rank; then each range runs as
    a prefill chunk against the keys up to its end (xattn_prefill_rows: the estimate, the
    selection and the attention of those rows exactly as in one call over the whole
    sequence). Returns the rank's out [B, Hq, n, D]."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranges, total = _check_ranges(ranges, world)
    _check_granularity(ranges, total, prefill_kwargs.get("block_size", BLOCK),
                       "whole blocks of the block size")
    k_all, v_all = _gather_sequences(
        [("key_states", key_states, ranges, 2), ("value_states", value_states, ranges, 2)],
        rank, world, group)
    return xattn_prefill_rows(query_states, k_all, v_all, stride, ranges=ranges[rank],
                              **prefill_kwargs)
