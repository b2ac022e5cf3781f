"""The ops as torch custom ops (torch.ops.sparse_attn.*), so that torch.compile sees each
call as one opaque op with known outputs and CUDA graphs (mode="reduce-overhead") capture
it. Every op writes into caller-allocated outputs (mutates_args) and returns nothing, which
makes the fake implementations trivial: the wrappers in qsa.py allocate with torch.empty,
which the compiler traces. Without torch, or with a torch that predates
torch.library.custom_op, nothing is registered and the plain functions still work.

Eager calls do not go through these ops (the dispatcher costs more than the whole binding);
_runtime.run routes only compiled code here."""

from typing import List, Optional

from . import _C
from . import _runtime as rt

torch = rt.torch


def _register():
    Tensor = torch.Tensor
    custom_op = torch.library.custom_op

    def no_outputs(*args):
        return None

    def define(name, mutates, fn):
        op = custom_op(f"sparse_attn::{name}", fn, mutates_args=mutates)
        op.register_fake(no_outputs)

    def qsa_indexer_mqa_score(
        q_idx: Tensor, block_keys: Tensor, out: Tensor, block_table: Optional[Tensor],
        page_size: Optional[int], cu_seqlens_q: Optional[Tensor],
        token_to_req: Optional[Tensor], num_requests: Optional[int],
        query_positions: Optional[Tensor], seq_lens_q: Optional[Tensor], block_size: int,
        scale: Optional[float], score_scale: Optional[float], kv_cache_dtype: Optional[str],
        backend: str,
    ) -> None:
        _C.qsa_indexer_mqa_score(
            q_idx, block_keys, out, block_table, page_size, cu_seqlens_q, token_to_req,
            num_requests, query_positions, seq_lens_q, block_size, scale, score_scale,
            kv_cache_dtype, backend, rt.torch_stream(q_idx))

    def qsa_mqa_prefill(
        q: Tensor, k: Tensor, row_starts: Tensor, row_ends: Tensor, out: Tensor,
        score_scale: Optional[float], scale: Optional[float], kv_cache_dtype: Optional[str],
        backend: str,
    ) -> None:
        _C.qsa_mqa_prefill(q, k, row_starts, row_ends, out, score_scale, scale, kv_cache_dtype,
                           backend, rt.torch_stream(q))

    def qsa_mqa_decode(
        q: Tensor, k_cache: Tensor, page_table: Tensor, context_lens: Tensor,
        max_model_len: int, out: Tensor, score_scale: Optional[float], scale: Optional[float],
        kv_cache_dtype: Optional[str], backend: str,
    ) -> None:
        _C.qsa_mqa_decode(q, k_cache, page_table, context_lens, max_model_len, out, score_scale,
                          scale, kv_cache_dtype, backend, rt.torch_stream(q))

    def qsa_sparse_attention(
        query: Tensor, key: Tensor, value: Tensor, token_indices: Optional[Tensor],
        out: Tensor, lse: Optional[Tensor], block_indices: Optional[Tensor],
        cu_seqlens_q: Optional[Tensor], token_to_req: Optional[Tensor],
        num_requests: Optional[int], cu_seqlens_k: Optional[Tensor],
        seq_lens_q: Optional[Tensor], seq_lens_k: Optional[Tensor],
        query_positions: Optional[Tensor], block_table: Optional[Tensor],
        page_size: Optional[int], scale: Optional[float], gate: Optional[Tensor],
        num_splits: Optional[int], backend: str, warp_specialized: bool,
        assume_compact_blocks: bool, selected_kv_indices: Optional[Tensor],
        softmax_scale: Optional[float], k_scale: float, v_scale: float,
        compute_dtype: torch.dtype, kv_cache_dtype: Optional[str], workspace: Optional[Tensor],
    ) -> None:
        # Without a workspace the scratch comes from torch's allocator here, when the op runs
        # (under CUDA graph capture: from the graph's private pool).
        _C.qsa_sparse_attention(
            query, key, value, token_indices, out, lse, block_indices, cu_seqlens_q,
            token_to_req, num_requests, cu_seqlens_k, seq_lens_q, seq_lens_k, query_positions,
            block_table, page_size, scale, gate, num_splits, backend, warp_specialized,
            assume_compact_blocks, selected_kv_indices, softmax_scale, k_scale, v_scale,
            compute_dtype, kv_cache_dtype,
            rt.workspace_allocator(query) if workspace is None else workspace,
            rt.torch_stream(query))

    def qsa_compress_block_keys(
        keys: Tensor, weight: Tensor, out: Tensor, eps: float, cos: Optional[Tensor],
        sin: Optional[Tensor], rope_theta: Optional[float], rope_dim: int, rope_style: str,
        cu_seqlens: Optional[Tensor], start_positions: Optional[Tensor],
        block_table: Optional[Tensor], page_size: Optional[int], backend: str,
    ) -> None:
        _C.qsa_compress_block_keys(keys, weight, out, eps, cos, sin, rope_theta, rope_dim,
                                   rope_style, cu_seqlens, start_positions, block_table,
                                   page_size, backend, rt.torch_stream(keys))

    def qsa_topk_blocks(scores: Tensor, k: int, out: Tensor) -> None:
        _C.qsa_topk_blocks(scores, k, out, rt.torch_stream(scores))

    def qsa_expand_blocks(block_ids: Tensor, query_positions: Tensor, token_indices: Tensor,
                          block_indices: Optional[Tensor]) -> None:
        _C.qsa_expand_blocks(block_ids, query_positions, token_indices, block_indices,
                             rt.torch_stream(block_ids))

    def qsa_indexer_select(
        q_idx: Tensor, block_keys: Tensor, topk: int, out: Tensor,
        token_indices: Optional[Tensor], valid_counts: Optional[Tensor],
        block_table: Optional[Tensor], page_size: Optional[int], cu_seqlens_q: Optional[Tensor],
        token_to_req: Optional[Tensor], num_requests: Optional[int],
        query_positions: Optional[Tensor], seq_lens_q: Optional[Tensor], block_size: int,
        scale: Optional[float], score_scale: Optional[float], kv_cache_dtype: Optional[str],
        backend: str, max_workspace_bytes: Optional[int], workspace: Optional[Tensor],
    ) -> None:
        _C.qsa_indexer_select(
            q_idx, block_keys, topk, out, token_indices, valid_counts, block_table, page_size,
            cu_seqlens_q, token_to_req, num_requests, query_positions, seq_lens_q, block_size,
            scale, score_scale, kv_cache_dtype, backend, max_workspace_bytes, workspace,
            rt.torch_stream(q_idx))

    def qsa_mqa_decode_select(
        q: Tensor, k_cache: Tensor, page_table: Tensor, context_lens: Tensor,
        max_model_len: int, topk: int, out: Tensor, token_indices: Optional[Tensor],
        valid_counts: Optional[Tensor], query_positions: Optional[Tensor],
        score_scale: Optional[float], scale: Optional[float], kv_cache_dtype: Optional[str],
        backend: str, max_workspace_bytes: Optional[int], workspace: Optional[Tensor],
    ) -> None:
        _C.qsa_mqa_decode_select(
            q, k_cache, page_table, context_lens, max_model_len, topk, out, token_indices,
            valid_counts, query_positions, score_scale, scale, kv_cache_dtype, backend,
            max_workspace_bytes, workspace, rt.torch_stream(q))

    def merge_attention_states(partial_out: Tensor, partial_lse: Tensor, out: Tensor,
                               lse_out: Optional[Tensor], backend: str) -> None:
        _C.merge_attention_states(partial_out, partial_lse, out, lse_out, backend,
                                  rt.torch_stream(partial_out))

    def xattn_estimate(
        query: Tensor, key: Tensor, attn_sums: Tensor, block_mask: Tensor, threshold: float,
        head_thresholds: Optional[List[float]], causal: bool, keep_sink: bool,
        keep_recent: bool, block_size: int, stride: int, norm: float, chunk_size: int,
        select_mode: str, backend: str,
    ) -> None:
        _C.xattn_estimate(query, key, attn_sums, block_mask, threshold, head_thresholds, causal,
                          keep_sink, keep_recent, block_size, stride, norm, chunk_size,
                          select_mode, backend, rt.torch_stream(query))

    def find_blocks_chunked(
        attn_sums: Tensor, block_mask: Tensor, threshold: float,
        head_thresholds: Optional[List[float]], causal: bool, keep_sink: bool,
        keep_recent: bool, block_size: int, q_len: Optional[int], k_len: Optional[int],
        backend: str,
    ) -> None:
        _C.find_blocks_chunked(attn_sums, block_mask, threshold, head_thresholds, causal,
                               keep_sink, keep_recent, block_size, q_len, k_len, backend,
                               rt.torch_stream(attn_sums))

    def block_sparse_attention(
        q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        base_blockmask: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, out: Tensor,
        lse: Optional[Tensor], head_mask_type: Optional[List[int]],
        streaming_info: Optional[List[int]], softmax_scale: Optional[float], is_causal: bool,
        p_dropout: float, backend: str,
    ) -> None:
        _C.block_sparse_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, base_blockmask,
                                  max_seqlen_q, max_seqlen_k, out, lse, head_mask_type,
                                  streaming_info, softmax_scale, is_causal, p_dropout, backend,
                                  rt.torch_stream(q))

    def block_sparse_attention_paged(
        q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqlens_k: Tensor,
        cu_seqlens_q: Tensor, base_blockmask: Optional[Tensor], max_seqlen_q: int,
        max_seqlen_k: int, out: Tensor, lse: Optional[Tensor],
        head_mask_type: Optional[List[int]], streaming_info: Optional[List[int]],
        softmax_scale: Optional[float], is_causal: bool, p_dropout: float, backend: str,
    ) -> None:
        _C.block_sparse_attention_paged(q, k_cache, v_cache, block_table, seqlens_k,
                                        cu_seqlens_q, base_blockmask, max_seqlen_q,
                                        max_seqlen_k, out, lse, head_mask_type, streaming_info,
                                        softmax_scale, is_causal, p_dropout, backend,
                                        rt.torch_stream(q))

    def xattention_prefill(
        query: Tensor, key: Tensor, value: Tensor, attn_sums: Tensor, block_mask: Tensor,
        out: Tensor, lse: Optional[Tensor], threshold: float,
        head_thresholds: Optional[List[float]], causal: bool, keep_sink: bool,
        keep_recent: bool, block_size: int, stride: int, norm: float, chunk_size: int,
        select_mode: str, softmax_scale: Optional[float], backend: str,
    ) -> None:
        _C.xattention_prefill(query, key, value, attn_sums, block_mask, out, lse, threshold,
                              head_thresholds, causal, keep_sink, keep_recent, block_size,
                              stride, norm, chunk_size, select_mode, softmax_scale, backend,
                              rt.torch_stream(query))

    def xattention_prefill_paged(
        query: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, k_len: int,
        attn_sums: Tensor, block_mask: Tensor, out: Tensor, lse: Optional[Tensor],
        threshold: float, head_thresholds: Optional[List[float]], causal: bool, keep_sink: bool,
        keep_recent: bool, block_size: int, stride: int, norm: float, chunk_size: int,
        select_mode: str, softmax_scale: Optional[float], backend: str,
    ) -> None:
        _C.xattention_prefill_paged(query, k_cache, v_cache, block_table, k_len, attn_sums,
                                    block_mask, out, lse, threshold, head_thresholds, causal,
                                    keep_sink, keep_recent, block_size, stride, norm, chunk_size,
                                    select_mode, softmax_scale, backend, rt.torch_stream(query))

    define("qsa_indexer_mqa_score", ("out",), qsa_indexer_mqa_score)
    define("qsa_mqa_prefill", ("out",), qsa_mqa_prefill)
    define("qsa_mqa_decode", ("out",), qsa_mqa_decode)
    define("qsa_sparse_attention", ("out", "lse", "workspace"), qsa_sparse_attention)
    define("qsa_compress_block_keys", ("out",), qsa_compress_block_keys)
    define("qsa_topk_blocks", ("out",), qsa_topk_blocks)
    define("qsa_expand_blocks", ("token_indices", "block_indices"), qsa_expand_blocks)
    define("qsa_indexer_select", ("out", "token_indices", "valid_counts", "workspace"),
           qsa_indexer_select)
    define("qsa_mqa_decode_select", ("out", "token_indices", "valid_counts", "workspace"),
           qsa_mqa_decode_select)
    define("merge_attention_states", ("out", "lse_out"), merge_attention_states)
    define("xattn_estimate", ("attn_sums", "block_mask"), xattn_estimate)
    define("find_blocks_chunked", ("block_mask",), find_blocks_chunked)
    define("block_sparse_attention", ("out", "lse"), block_sparse_attention)
    define("block_sparse_attention_paged", ("out", "lse"), block_sparse_attention_paged)
    define("xattention_prefill", ("attn_sums", "block_mask", "out", "lse"), xattention_prefill)
    define("xattention_prefill_paged", ("attn_sums", "block_mask", "out", "lse"),
           xattention_prefill_paged)
    rt.ops_registered = True


if torch is not None and hasattr(torch.library, "custom_op") and rt._is_compiling is not None:
    _register()
