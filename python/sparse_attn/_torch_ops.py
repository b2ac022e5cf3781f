"""The ops as torch custom ops (torch.ops.sparse_attn.*), so that torch.compile sees each
call as one opaque op with known outputs and CUDA graphs (mode="reduce-overhead") capture
it. Every op writes into caller-allocated outputs (mutates_args) and returns nothing, which
makes the fake implementations trivial: the wrappers in qsa.py allocate with torch.empty,
which the compiler traces. Without torch, or with a torch that predates
torch.library.custom_op, nothing is registered and the plain functions still work.

Eager calls do not go through these ops (the dispatcher costs more than the whole binding);
_runtime.run routes only compiled code here."""

from typing import Optional

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
        scale: Optional[float], score_scale: Optional[float], backend: str,
    ) -> None:
        _C.qsa_indexer_mqa_score(
            q_idx, block_keys, out, block_table, page_size, cu_seqlens_q, token_to_req,
            num_requests, query_positions, seq_lens_q, block_size, scale, score_scale, backend,
            rt.torch_stream(q_idx))

    def qsa_mqa_prefill(
        q: Tensor, k: Tensor, row_starts: Tensor, row_ends: Tensor, out: Tensor,
        score_scale: Optional[float], scale: Optional[float], backend: str,
    ) -> None:
        _C.qsa_mqa_prefill(q, k, row_starts, row_ends, out, score_scale, scale, backend,
                           rt.torch_stream(q))

    def qsa_mqa_decode(
        q: Tensor, k_cache: Tensor, page_table: Tensor, context_lens: Tensor,
        max_model_len: int, out: Tensor, score_scale: Optional[float], scale: Optional[float],
        backend: str,
    ) -> None:
        _C.qsa_mqa_decode(q, k_cache, page_table, context_lens, max_model_len, out, score_scale,
                          scale, backend, rt.torch_stream(q))

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
        compute_dtype: torch.dtype,
    ) -> None:
        _C.qsa_sparse_attention(
            query, key, value, token_indices, out, lse, block_indices, cu_seqlens_q,
            token_to_req, num_requests, cu_seqlens_k, seq_lens_q, seq_lens_k, query_positions,
            block_table, page_size, scale, gate, num_splits, backend, warp_specialized,
            assume_compact_blocks, selected_kv_indices, softmax_scale, k_scale, v_scale,
            compute_dtype, rt.torch_stream(query))

    define("qsa_indexer_mqa_score", ("out",), qsa_indexer_mqa_score)
    define("qsa_mqa_prefill", ("out",), qsa_mqa_prefill)
    define("qsa_mqa_decode", ("out",), qsa_mqa_decode)
    define("qsa_sparse_attention", ("out", "lse"), qsa_sparse_attention)
    rt.ops_registered = True


if torch is not None and hasattr(torch.library, "custom_op") and rt._is_compiling is not None:
    _register()
