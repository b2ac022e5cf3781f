"""The seeds' signatures: MATE's, copied verbatim from the QSA seed's "Entrypoints" section,
and those of the code the XAttention seed names (mit-han-lab's x-attention xattn_estimate,
find_blocks_chunked, Xattention_prefill; Block-Sparse-Attention's block_sparse_attn_func).
Every sparse_attn function must accept the same parameters, in the same order, of the same
kind, with the same defaults (extensions may only add keyword-only parameters at the end),
and a script written for them must run with only the import changed."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import sparse_attn

SEED = {
    "qsa_indexer_mqa_score": "q_idx: torch.Tensor, block_keys: torch.Tensor, *, block_table: torch.Tensor | None = None, page_size: int | None = None, cu_seqlens_q: torch.Tensor | None = None, token_to_req: torch.Tensor | None = None, num_requests: int | None = None, query_positions: torch.Tensor | None = None, seq_lens_q: torch.Tensor | None = None, block_size: int = 4, scale: float | None = None, score_scale: float | None = None, backend: str = 'tilelang'",  # noqa: E501
    "qsa_mqa": "q: torch.Tensor, k: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor, score_scale: float | None = None, *, scale: float | None = None, backend: str = 'tilelang'",  # noqa: E501
    "qsa_mqa_decode": "q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor, context_lens: torch.Tensor, max_model_len: int, score_scale: float | None = None, *, scale: float | None = None, backend: str = 'tilelang'",  # noqa: E501
    "qsa_mqa_prefill": "q: torch.Tensor, k: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor, score_scale: float | None = None, *, scale: float | None = None, backend: str = 'tilelang'",  # noqa: E501
    "qsa_sparse_attention": "query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, token_indices: torch.Tensor | None = None, *, block_indices: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None, token_to_req: torch.Tensor | None = None, num_requests: int | None = None, cu_seqlens_k: torch.Tensor | None = None, seq_lens_q: torch.Tensor | None = None, seq_lens_k: torch.Tensor | None = None, query_positions: torch.Tensor | None = None, block_table: torch.Tensor | None = None, page_size: int | None = None, scale: float | None = None, gate: torch.Tensor | None = None, num_splits: int | None = None, return_lse: bool = False, backend: str = 'tilelang', warp_specialized: bool = False, assume_compact_blocks: bool = False, out: torch.Tensor | None = None, selected_kv_indices: torch.Tensor | None = None, softmax_scale: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0, compute_dtype: torch.dtype = torch.bfloat16, lse: torch.Tensor | None = None",  # noqa: E501
    "xattn_estimate": "query_states: torch.Tensor, key_states: torch.Tensor, block_size, stride, norm=1, softmax=True, threshold=0.9, chunk_size=16384, select_mode='inverse', use_triton=True, causal=True, kdb: int = 1, keep_sink=False, keep_recent=False",  # noqa: E501
    "find_blocks_chunked": "input_tensor, current_index, threshold, num_to_choose, decoding: bool, mode: str = 'both', causal=True",  # noqa: E501
    "Xattention_prefill": "query_states: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, stride, norm=1, threshold=0.8, block_size=128, use_triton=True, causal=True, kdb=1, chunk_size=None, keep_sink=False, keep_recent=False",  # noqa: E501
    "block_sparse_attn_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type, streaming_info, base_blockmask, max_seqlen_q_, max_seqlen_k_, p_dropout, deterministic=False, softmax_scale=None, is_causal=False, exact_streaming=False, return_attn_probs=False",  # noqa: E501
}


def seed_signature(name):
    scope = {"torch": torch}
    exec(f"from __future__ import annotations\ndef {name}({SEED[name]}): pass", scope)
    return inspect.signature(scope[name])


@pytest.mark.parametrize("name", sorted(SEED))
def test_signature_matches_the_seed(name):
    seed = list(seed_signature(name).parameters.values())
    ours = list(inspect.signature(getattr(sparse_attn, name)).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(seed)]] == \
        [(p.name, p.kind, p.default) for p in seed]
    for extra in ours[len(seed):]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY, extra


# A script written for the seed: every call spells out every parameter exactly as the
# signatures show (positional where they are positional, keywords otherwise), with the
# reference backend because this machine has no GPU (backend='tilelang' is the other case).

def test_seed_style_calls():
    H, D = 4, 128
    q_idx = torch.randn(1, 8, H, D, dtype=torch.bfloat16)
    block_keys = torch.randn(1, 2, D, dtype=torch.bfloat16)
    scores = sparse_attn.qsa_indexer_mqa_score(
        q_idx, block_keys, block_table=None, page_size=None, cu_seqlens_q=None,
        token_to_req=None, num_requests=None, query_positions=None, seq_lens_q=None,
        block_size=4, scale=None, score_scale=None, backend="reference")
    assert scores.shape == (1, 8, 2)
    assert scores[0, 3, 0].isfinite() and scores[0, 2, 0] == -math.inf

    q = torch.randn(5, H, D, dtype=torch.float16)
    k = torch.randn(7, 1, D, dtype=torch.float16)
    row_starts = torch.zeros(5, dtype=torch.int32)
    row_ends = torch.full((5,), 7, dtype=torch.int32)
    for fn in (sparse_attn.qsa_mqa, sparse_attn.qsa_mqa_prefill):
        logits = fn(q, k, row_starts, row_ends, None, scale=None, backend="reference")
        assert logits.shape == (5, 7)
        logits = fn(q, k, row_starts, row_ends, score_scale=16.0, backend="reference")
        assert logits.shape == (5, 7)

    k_cache = torch.randn(2, 8, 1, D, dtype=torch.bfloat16)
    page_table = torch.tensor([[1, 0]], dtype=torch.int32)
    context_lens = torch.tensor([12], dtype=torch.int32)
    decode = sparse_attn.qsa_mqa_decode(q_idx[:, 0], k_cache, page_table, context_lens, 16, None,
                                        scale=None, backend="reference")
    assert decode.shape == (1, 16) and (decode[0, 12:] == -math.inf).all()

    query = torch.randn(1, 3, 24, 256, dtype=torch.bfloat16)
    key = torch.randn(1, 16, 2, 256, dtype=torch.bfloat16)
    value = torch.randn(1, 16, 2, 256, dtype=torch.bfloat16)
    token_indices = torch.tensor([[[0, 5, 13, -1], [1, 2, 3, 14], [15, 15, -1, -1]]],
                                 dtype=torch.int32)
    out, lse = sparse_attn.qsa_sparse_attention(
        query, key, value, token_indices, block_indices=None, cu_seqlens_q=None,
        token_to_req=None, num_requests=None, cu_seqlens_k=None, seq_lens_q=None,
        seq_lens_k=None, query_positions=None, block_table=None, page_size=None, scale=None,
        gate=None, num_splits=None, return_lse=True, backend="reference",
        warp_specialized=False, assume_compact_blocks=False, out=None,
        selected_kv_indices=None, softmax_scale=None, k_scale=1.0, v_scale=1.0,
        compute_dtype=torch.bfloat16, lse=None)
    assert out.shape == query.shape and lse.shape == (1, 3, 24)
    only_out = sparse_attn.qsa_sparse_attention(query, key, value, token_indices,
                                                backend="reference")
    assert torch.equal(only_out, out)


def test_tilelang_is_the_default_and_an_alias_of_native():
    # On CPU tensors the native backend is the CPU backend, whose FP32 accumulation gives other
    # low bits than the reference's FP64: the default, 'tilelang' and 'native' agree bit for
    # bit with each other and not with the reference.
    torch.manual_seed(0)
    q = torch.randn(300, 2, 64)
    k = torch.randn(300, 1, 64)
    v = torch.randn(300, 1, 64)
    cu = torch.tensor([0, 300], dtype=torch.int32)

    def run(**kw):
        return sparse_attn.block_sparse_attn_func(q, k, v, cu, cu, [0, 0], None, None, 300, 300,
                                                  0.0, is_causal=True, **kw)

    default = run()
    assert torch.equal(default, run(backend="tilelang"))
    assert torch.equal(default, run(backend="native"))
    reference = run(backend="reference")
    assert not torch.equal(default, reference)
    assert torch.allclose(default, reference, atol=1e-5, rtol=1e-5)


def test_xattention_seed_style_calls():
    # As the XAttention guide and the reference code call them (backend is the one
    # extension: this machine has no GPU).
    B, H, L, D = 1, 2, 256, 64
    query_states = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    key_states = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    value_states = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    attn_sums, simple_masks = sparse_attn.xattn_estimate(
        query_states, key_states, 128, 8, 1, True, 0.9, 16384, "inverse", True, True, 1, False,
        False, backend="reference")
    assert attn_sums.shape == simple_masks.shape == (B, H, 2, 2)
    mask = sparse_attn.find_blocks_chunked(attn_sums, 0, 0.9, None, decoding=False,
                                           mode="prefill", causal=True, backend="reference")
    assert torch.equal(mask, simple_masks)
    attn_output = sparse_attn.Xattention_prefill(
        query_states, key_states, value_states, 8, norm=1, threshold=0.9, block_size=128,
        use_triton=True, causal=True, kdb=1, chunk_size=None, keep_sink=False,
        keep_recent=False, backend="reference")
    assert attn_output.shape == (B, H, L, D)
    # Phase 4 of the guide: block_sparse_attn_func on [total, heads, dim] views.
    q_len = k_len = L
    q_cu_seq_lens = torch.tensor([0, q_len], dtype=torch.int32)
    k_cu_seq_lens = torch.tensor([0, k_len], dtype=torch.int32)
    head_mask_type = torch.ones(H, dtype=torch.int32)
    bsa = sparse_attn.block_sparse_attn_func(
        query_states.transpose(1, 2).reshape(q_len, H, D),
        key_states.transpose(1, 2).reshape(k_len, H, D),
        value_states.transpose(1, 2).reshape(k_len, H, D),
        q_cu_seq_lens, k_cu_seq_lens, head_mask_type, None, simple_masks, q_len, k_len,
        p_dropout=0.0, deterministic=True, is_causal=True, backend="reference")
    assert torch.equal(bsa.view(q_len, H, D).transpose(0, 1)[None], attn_output)
