"""qsa_topk_blocks and qsa_expand_blocks through the Python API against plain-Python
statements of their rules (SPEC.md "Top-k and expansion"), and the indexer -> top-k ->
expansion -> sparse attention pipeline."""

import math

import numpy as np
import pytest
import torch

import sparse_attn
from qsa_testing import DEVICES, expand_blocks, randn


def ref_topk(scores, k):
    flat = scores.reshape(-1, scores.shape[-1]).double().cpu()
    out = torch.full((flat.shape[0], k), -1, dtype=torch.int32)
    for r, row in enumerate(flat.tolist()):
        visible = sorted((-v, i) for i, v in enumerate(row) if math.isfinite(v))
        ids = [i for _, i in visible[:k]]
        out[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out.reshape(*scores.shape[:-1], k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,k", [((7, 40), 5), ((2, 3, 33), 8), ((4, 6), 10), ((3, 600), 512)],
                         ids=["rows7_n40_k5", "b2_q3_n33_k8", "k_above_n", "k512"])
def test_topk_matches_rule(device, shape, k):
    # Few distinct values: many ties, which must go to the lower block id.
    scores = torch.randint(0, 5, shape).float()
    scores[torch.rand(shape) < 0.3] = -math.inf
    scores[..., 0] = math.nan
    scores[..., 1] = math.inf
    scores = scores.to(device)
    out = sparse_attn.qsa_topk_blocks(scores, k)
    assert out.dtype == torch.int32 and out.device == scores.device
    assert torch.equal(out.cpu(), ref_topk(scores, k))


def test_topk_default_k_is_512_and_out_identity():
    scores = torch.randn(2, 700)
    out = torch.empty((2, 512), dtype=torch.int32)
    assert sparse_attn.qsa_topk_blocks(scores, out=out) is out
    assert sparse_attn.QSA_TOPK_BLOCKS == 512
    assert torch.equal(out, ref_topk(scores, 512))


@pytest.mark.parametrize("device", DEVICES)
def test_expand_matches_rule(device):
    rows, nb = 9, 6
    positions = torch.tensor([0, 2, 3, 4, 7, 30, 31, 33, 100], dtype=torch.int32)
    blocks = torch.randint(-1, 30, (rows, nb), dtype=torch.int32)
    tokens, kept = sparse_attn.qsa_expand_blocks(blocks.to(device), positions.to(device),
                                                 return_block_indices=True)
    ref_tokens, ref_kept = expand_blocks(blocks, positions)
    assert tokens.shape == (rows, 4 * nb + 3)
    assert torch.equal(tokens.cpu(), ref_tokens) and torch.equal(kept.cpu(), ref_kept)
    only_tokens = sparse_attn.qsa_expand_blocks(blocks.to(device), positions.to(device))
    assert torch.equal(only_tokens, tokens)


def test_expand_into_given_outputs_on_padded_rows():
    blocks = torch.tensor([[[0, 2, -1]], [[1, 0, 3]]], dtype=torch.int32)  # [B, Q, k]
    positions = torch.tensor([[13], [15]], dtype=torch.int32)
    tokens = torch.full((2, 1, 15), 99, dtype=torch.int32)
    kept = torch.full((2, 1, 3), 99, dtype=torch.int32)
    result = sparse_attn.qsa_expand_blocks(blocks, positions, return_block_indices=True,
                                           token_indices=tokens, block_indices=kept)
    assert result[0] is tokens and result[1] is kept
    ref_tokens, ref_kept = expand_blocks(blocks.reshape(2, 3), positions.reshape(2))
    assert torch.equal(tokens.reshape(2, 15), ref_tokens)
    assert torch.equal(kept.reshape(2, 3), ref_kept)


def test_numpy_selection():
    scores = np.array([[0.5, -np.inf, 2.0, 2.0]], dtype=np.float32)
    ids = sparse_attn.qsa_topk_blocks(scores, 3)
    assert isinstance(ids, np.ndarray) and ids.tolist() == [[2, 3, 0]]
    tokens = sparse_attn.qsa_expand_blocks(ids, np.array([13], dtype=np.int32))
    assert tokens.tolist() == [[8, 9, 10, 11, 0, 1, 2, 3, 12, 13] + [-1] * 5]


def test_indexer_topk_expand_attention_pipeline():
    # The seed's caller-side pipeline, end to end through the Python API, against attention
    # over the explicitly selected tokens.
    B, Q, N, H, D = 1, 4, 12, 4, 128
    q_idx = randn((B, Q, H, D), torch.bfloat16, "cpu")
    block_keys = randn((B, N, D), torch.bfloat16, "cpu")
    seq_len = 4 * N
    positions = torch.arange(seq_len - Q, seq_len, dtype=torch.int32)[None]
    scores = sparse_attn.qsa_indexer_mqa_score(q_idx, block_keys, query_positions=positions,
                                               backend="reference")
    blocks = sparse_attn.qsa_topk_blocks(scores, 3)
    tokens, hint = sparse_attn.qsa_expand_blocks(blocks, positions, return_block_indices=True)
    query = randn((B, Q, 24, 256), torch.bfloat16, "cpu")
    key, value = randn((B, seq_len, 2, 256), torch.bfloat16, "cpu"), \
        randn((B, seq_len, 2, 256), torch.bfloat16, "cpu")
    out = sparse_attn.qsa_sparse_attention(query, key, value, tokens, block_indices=hint,
                                           query_positions=positions, backend="reference")
    # Same result from the reference with the ids in a different order (softmax over a set).
    shuffled = tokens.clone()
    for r in range(Q):
        valid = shuffled[0, r][shuffled[0, r] >= 0]
        shuffled[0, r, :len(valid)] = valid[torch.randperm(len(valid))]
    again = sparse_attn.qsa_sparse_attention(query, key, value, shuffled,
                                             query_positions=positions, backend="reference")
    torch.testing.assert_close(out, again, rtol=1e-2, atol=1e-2)


def test_selection_errors_name_the_argument():
    with pytest.raises(ValueError, match="^k"):
        sparse_attn.qsa_topk_blocks(torch.randn(2, 5), 0)
    with pytest.raises(TypeError, match="scores"):
        sparse_attn.qsa_topk_blocks(torch.randn(2, 5).half(), 2)
    with pytest.raises(TypeError, match="block_ids"):
        sparse_attn.qsa_expand_blocks(torch.zeros((2, 3), dtype=torch.float32),
                                      torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="^query_positions: expected a tensor"):
        sparse_attn.qsa_expand_blocks(torch.zeros((2, 3), dtype=torch.int32), [5, 6])
