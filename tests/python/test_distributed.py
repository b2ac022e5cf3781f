"""sparse_attn.distributed (context parallelism): the sharded top-k, QSA sparse attention and
XAttention block-sparse attention against the single-process ops on the whole inputs.

Two kinds of tests:

* simulated ranks (one process, no process group): the per-rank pieces called for every shard,
  their partials checked against the op on the whole cache restricted to the shard's tokens
  (bitwise: the same tokens in the same order), merged with a float64 LSE merge written here
  and with the library's merge;
* real process groups of 2 and 3 ranks on gloo (CPU tensors), started from a forkserver (one
  server per test session, so a world costs a fork and a rendezvous, not an interpreter with
  torch), each rank holding one shard of inputs every rank draws from the same seed.
"""

import datetime
import math
import multiprocessing
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import sparse_attn
from sparse_attn import distributed as sd
from qsa_testing import DEVICES, assert_close, needs_cuda

HAS_GLOO = dist.is_available() and dist.is_gloo_available()
needs_gloo = pytest.mark.skipif(not HAS_GLOO, reason="torch.distributed has no gloo backend")

OUT_TOL = {torch.bfloat16: dict(rtol=1e-2, atol=1e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}
LSE_TOL = dict(rtol=1e-4, atol=1e-4)
BLOCK = 128


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def merge_oracle(outs, lses):
    """float64 LSE merge of [N, ..., H, D] / [N, ..., H] partials: (out, lse)."""
    lses = lses.double()
    m = lses.max(0).values
    m_safe = torch.where(m == -math.inf, 0.0, m)
    w = torch.exp(lses - m_safe)
    total = w.sum(0)
    out = (w[..., None] * outs.double()).sum(0) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, m_safe + torch.log(torch.where(total > 0, total, 1.0)),
                      -math.inf)
    return out, lse


def gated(out, gate):
    """The op's gate applied to an output (docs/qsa.md, "Gate")."""
    factor = 1.0 / (1.0 + torch.exp(-gate.float()))
    if gate.dim() == out.dim() - 1:
        factor = factor[..., None]
    return (out.to(gate.dtype).float() * factor).to(gate.dtype)


# --------------------------------------------------------------------------------------------
# Cases, drawn from a seed (every rank draws the same)


def shard_bounds(total, cuts):
    """[(start, len)] from cut points: cuts (7, 30) of 48 -> (0, 7), (7, 23), (30, 18)."""
    edges = [0, *cuts, total]
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


def topk_case(seed, shape, nb):
    g = _gen(seed)
    scores = (torch.randint(0, 6, (*shape, nb), generator=g).float() * 0.5 - 1.0)  # many ties
    r = torch.rand((*shape, nb), generator=g)
    scores[r < 0.25] = -math.inf
    scores[(scores == 0) & (r > 0.6)] = -0.0  # -0 ties with +0
    scores[(r > 0.95)] = math.inf  # never selected
    scores[(r > 0.25) & (r < 0.27)] = math.nan  # never selected
    flat = scores.view(-1, nb)
    flat[0] = -math.inf  # a row with nothing visible
    flat[1, 3:] = -math.inf  # a row with fewer visible blocks than k
    return scores


TOPK_CASES = [
    # (seed, leading shape, blocks, k, shards as cut points, rank -> shard permutation or None)
    (1, (5,), 37, 4, {2: (19,), 3: (10, 10)}, None),  # an empty shard for 3 ranks
    (2, (2, 3), 37, 16, {2: (5,), 3: (3, 30)}, None),
    (3, (4,), 23, 50, {2: (23,), 3: (0, 23)}, None),  # k > blocks; one shard holds everything
    (4, (6,), 41, 8, {2: (30,), 3: (12, 20)}, {2: (1, 0), 3: (2, 0, 1)}),  # not in rank order
]


def qsa_case(kind, seed, dtype=torch.bfloat16, gate_kind=None, seq_lens=False, d=32):
    """A QSA attention problem on padded K/V [B, S, Hkv, D]: dict of the op's arguments."""
    g = _gen(seed)
    hq, hkv, S = 4, 2, 48
    if kind == "decode":
        B, W = 3, 24
        positions = torch.tensor([[47], [30], [5]], dtype=torch.int64)
        query = _randn((B, 1, hq, d), dtype, g)
        ids = torch.randint(-1, S + 4, (B, 1, W), generator=g, dtype=torch.int32)
        lead = (B, 1)
    else:  # prefill: one request, flattened query rows 38 .. 47
        B, T, W = 1, 10, 30
        positions = torch.arange(S - T, S, dtype=torch.int32)
        query = _randn((T, hq, d), dtype, g)
        ids = torch.randint(-1, S + 4, (T, W), generator=g, dtype=torch.int64)
        ids[:, :3] = ids[:, 3:6]  # duplicates count twice, in whichever shard they fall
        lead = (T,)
    case = dict(query=query, key=_randn((B, S, hkv, d), dtype, g),
                value=_randn((B, S, hkv, d), dtype, g), token_indices=ids,
                query_positions=positions, scale=0.3)
    if gate_kind == "elementwise":
        case["gate"] = _randn((*lead, hq, d), dtype, g, 2.0)
    elif gate_kind == "per_head":
        case["gate"] = _randn((*lead, hq), dtype, g, 2.0)
    if seq_lens:
        case["seq_lens_k"] = torch.tensor([40, 31, 6][:B], dtype=torch.int32)
    return case


def without_shard_tokens(case, start, length):
    """The case with every id inside [start, start + length) replaced by -1 (that shard then
    holds no selected token)."""
    ids = case["token_indices"]
    ids = torch.where((ids >= start) & (ids < start + length), -1, ids)
    return {**case, "token_indices": ids}


def key_shard(case, start, length, paged=False, page_size=4, seed=0):
    """The shard's K/V (tokens start .. start + length - 1 of every request) and its layout
    keywords: padded, or a paged cache with its own scrambled block table."""
    key, value = case["key"][:, start:start + length], case["value"][:, start:start + length]
    if not paged:
        return key.contiguous(), value.contiguous(), {}
    B, hkv, d = key.shape[0], key.shape[2], key.shape[3]
    per_req = max(1, -(-length // page_size))
    pages = B * per_req + 1
    perm = torch.randperm(pages, generator=_gen(seed + 100))
    table = perm[:B * per_req].view(B, per_req).to(torch.int32)
    k_cache = torch.full((pages, page_size, hkv, d), float("nan"), dtype=key.dtype)
    v_cache = torch.full((pages, page_size, hkv, d), float("nan"), dtype=key.dtype)
    for b in range(B):
        for t in range(length):
            k_cache[table[b, t // page_size], t % page_size] = key[b, t]
            v_cache[table[b, t // page_size], t % page_size] = value[b, t]
    return k_cache, v_cache, dict(block_table=table, page_size=page_size)


def qsa_reference(case, backend):
    return sparse_attn.qsa_sparse_attention(
        case["query"], case["key"], case["value"], case["token_indices"],
        **{k: v for k, v in case.items() if k not in ("query", "key", "value", "token_indices")},
        return_lse=True, backend=backend)


# (name, kind, gate, seq_lens, paged, cuts per world, shard left without tokens per world)
QSA_CASES = [
    ("decode", "decode", None, False, False, {2: (20,), 3: (7, 30)}, None),
    ("decode-gate-elementwise-seq-lens", "decode", "elementwise", True, False,
     {2: (8,), 3: (16, 17)}, None),
    ("prefill-gate-per-head-paged", "prefill", "per_head", False, True, {2: (25,), 3: (10, 44)},
     None),
    ("prefill-empty-shard", "prefill", None, False, False, {2: (20,), 3: (7, 30)},
     {2: 0, 3: 1}),
    ("decode-one-shard-holds-everything", "decode", None, False, False, {2: (48,), 3: (0, 48)},
     None),
]


def xattn_case(seed, q_len, k_len, dtype, heads="mixed", d=32):
    g = _gen(seed)
    hq, hkv = 4, 2
    qb, kb = -(-q_len // BLOCK), -(-k_len // BLOCK)
    if heads == "mixed":
        head_mask_type = [1, 0, -1, 1]
        streaming_info = [0, 0, 0, 0, 1, 2, 0, 0]
    else:
        head_mask_type, streaming_info = None, None
    sparse = hq if head_mask_type is None else sum(1 for t in head_mask_type if t == 1)
    mask = torch.rand((1, sparse, qb, kb), generator=g) < 0.5
    return dict(q=_randn((q_len, hq, d), dtype, g), k=_randn((k_len, hkv, d), dtype, g),
                v=_randn((k_len, hkv, d), dtype, g), base_blockmask=mask,
                head_mask_type=head_mask_type, streaming_info=streaming_info, k_len=k_len)


def xattn_reference(case, causal, backend):
    q, k = case["q"], case["k"]
    lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    out = sparse_attn.block_sparse_attn_func(
        q, k, case["v"], torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device),
        torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device),
        case["head_mask_type"], case["streaming_info"], case["base_blockmask"], q.shape[0],
        k.shape[0], 0.0, softmax_scale=0.25, is_causal=causal, backend=backend, lse=lse)
    return out, lse


def xattn_shard_kwargs(case, causal, block_start):
    return dict(k_len=case["k_len"], block_start=block_start,
                head_mask_type=case["head_mask_type"], streaming_info=case["streaming_info"],
                softmax_scale=0.25, is_causal=causal)


def block_shards(k_len, cuts):
    """[(block_start, first key, keys)] from block cut points."""
    kb = -(-k_len // BLOCK)
    edges = [0, *cuts, kb]
    return [(a, BLOCK * a, min(BLOCK * b, k_len) - min(BLOCK * a, k_len))
            for a, b in zip(edges, edges[1:])]


# (seed, q_len, k_len, dtype, heads, causal, block cuts per world)
XATTN_CASES = [
    # Shards that end inside the rows' causal range: a causal call for the rows whose limit
    # falls inside the shard, a non-causal one for the rest (not on a query block boundary).
    (11, 200, 600, torch.bfloat16, "mixed", True, {2: (4,), 3: (1, 1)}),  # 3: an empty shard
    (15, 300, 460, torch.bfloat16, "mixed", True, {2: (3,), 3: (2, 3)}),
    (12, 300, 300, torch.float32, "sparse", True, {2: (1,), 3: (1, 2)}),  # prefill from 0
    (13, 130, 520, torch.float32, "mixed", False, {2: (3,), 3: (0, 5)}),  # one holds all
    (14, 200, 100, torch.bfloat16, "sparse", True, {2: (1,), 3: (0, 1)}),  # Lq > Lk
]


# --------------------------------------------------------------------------------------------
# Simulated ranks: the per-rank pieces without a process group


def test_shard_token_indices_and_positions():
    ids = torch.tensor([[0, 6, 7, 29, 30, 47, -1, 60]], dtype=torch.int32)
    assert torch.equal(sd.qsa_shard_token_indices(ids, 7, 23),
                       torch.tensor([[-1, -1, 0, 22, -1, -1, -1, -1]], dtype=torch.int32))
    assert sd.qsa_shard_token_indices(ids.long(), 30, 18).dtype == torch.int64
    assert torch.equal(sd.qsa_shard_token_indices(ids, 30, 18),
                       torch.tensor([[-1, -1, -1, -1, 0, 17, -1, -1]], dtype=torch.int32))
    assert torch.equal(sd.qsa_shard_token_indices(ids, 10, 0), torch.full_like(ids, -1))
    positions = torch.tensor([47, 5, -1])
    assert torch.equal(sd.qsa_shard_positions(positions, 7), torch.tensor([40, -2, -8]))
    with pytest.raises(ValueError, match="shard_start"):
        sd.qsa_shard_token_indices(ids, -1, 3)
    with pytest.raises(TypeError, match="shard_len"):
        sd.qsa_shard_token_indices(ids, 0, 2.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,shape,nb,k,cuts,perm", TOPK_CASES)
def test_simulated_topk_equals_the_global_topk(seed, shape, nb, k, cuts, perm, device):
    scores = topk_case(seed, shape, nb).to(device)
    want = sparse_attn.qsa_topk_blocks(scores, k)
    for world in (1, 2, 3):
        bounds = [(0, nb)] if world == 1 else shard_bounds(nb, cuts[world])
        order = range(world) if perm is None or world == 1 else perm[world]
        parts = [sd.qsa_topk_blocks_local(scores[..., s:s + n].contiguous(), k, block_offset=s)
                 for s, n in (bounds[i] for i in order)]
        ids = torch.stack([p[0] for p in parts])
        vals = torch.stack([p[1] for p in parts])
        assert torch.equal(sd.qsa_topk_merge(ids, vals, k), want), (world, bounds)


def test_simulated_topk_of_indexer_scores_computed_on_each_shard():
    # Each shard scores its own compressed keys, positions shifted by 4 * block_offset (a key
    # b_local of the shard is block b_local + offset): the scores are the global scores' columns
    # bit for bit, and the merged top-k the global one.
    g = _gen(5)
    nb, rows = 30, 6
    q_idx = _randn((1, rows, 4, 32), torch.bfloat16, g)
    keys = _randn((1, nb, 32), torch.bfloat16, g)
    positions = torch.tensor([[3, 20, 57, 100, 119, 121]])
    scores = sparse_attn.qsa_indexer_mqa_score(q_idx, keys, query_positions=positions)
    want = sparse_attn.qsa_topk_blocks(scores, 8)
    parts = []
    for s, n in shard_bounds(nb, (9, 21)):
        local = sparse_attn.qsa_indexer_mqa_score(q_idx, keys[:, s:s + n].contiguous(),
                                                  query_positions=positions - 4 * s)
        assert torch.equal(local, scores[..., s:s + n])
        parts.append(sd.qsa_topk_blocks_local(local, 8, block_offset=s))
    got = sd.qsa_topk_merge(torch.stack([p[0] for p in parts]),
                            torch.stack([p[1] for p in parts]), 8)
    assert torch.equal(got, want)


def test_simulated_topk_of_decode_scores_computed_on_each_shard():
    # qsa_mqa_decode on a shard's pages: context_lens in the shard's coordinates,
    # clamp(context_lens - block_offset, 0, local_blocks).
    g = _gen(6)
    B, ps, max_pages = 3, 4, 8
    q = _randn((B, 4, 32), torch.bfloat16, g)
    k_cache = _randn((B * max_pages, ps, 32), torch.bfloat16, g)
    table = torch.randperm(B * max_pages, generator=g).view(B, max_pages).to(torch.int32)
    ctx = torch.tensor([32, 13, 2], dtype=torch.int32)
    scores = sparse_attn.qsa_mqa_decode(q, k_cache, table, ctx, ps * max_pages)
    want = sparse_attn.qsa_topk_blocks(scores, 6)
    parts = []
    for s, n in shard_bounds(ps * max_pages, (8, 20)):
        local = sparse_attn.qsa_mqa_decode(q, k_cache, table[:, s // ps:(s + n) // ps].contiguous(),
                                           (ctx - s).clamp(0, n), n)
        assert torch.equal(local, scores[:, s:s + n])
        parts.append(sd.qsa_topk_blocks_local(local, 6, block_offset=s))
    got = sd.qsa_topk_merge(torch.stack([p[0] for p in parts]),
                            torch.stack([p[1] for p in parts]), 6)
    assert torch.equal(got, want)


def _qsa_partials(case, bounds, backend, paged=False, device="cpu"):
    """Every shard's partial (qsa_sparse_attention_shard), its inputs moved to `device`."""
    kwargs = {k: v for k, v in case.items()
              if k not in ("query", "key", "value", "token_indices", "gate")}
    outs, lses = [], []
    for r, (s, n) in enumerate(bounds):
        k_sh, v_sh, layout = key_shard(case, s, n, paged=paged, seed=r)
        out, lse = sd.qsa_sparse_attention_shard(
            case["query"].to(device), k_sh.to(device), v_sh.to(device),
            case["token_indices"].to(device), shard_start=s, shard_len=n, backend=backend,
            **_on(kwargs, device), **_on(layout, device))
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _shard_alone(case, start, length):
    """The ungated case with only the ids inside [start, start + length): what one shard's
    partial must equal when computed on the whole cache."""
    ids = case["token_indices"]
    return {**{k: v for k, v in case.items() if k != "gate"},
            "token_indices": torch.where((ids >= start) & (ids < start + length), ids, -1)}


@pytest.mark.parametrize("name,kind,gate,seq_lens,paged,cuts,empty",
                         QSA_CASES, ids=[c[0] for c in QSA_CASES])
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_simulated_qsa_attention(name, kind, gate, seq_lens, paged, cuts, empty, backend):
    dt = torch.bfloat16
    for world in (2, 3):
        bounds = shard_bounds(48, cuts[world])
        case = qsa_case(kind, 7, dt, gate, seq_lens)
        if empty is not None:
            case = without_shard_tokens(case, *bounds[empty[world] if isinstance(empty, dict)
                                                     else empty])
        want, want_lse = qsa_reference(case, backend)
        outs, lses = _qsa_partials(case, bounds, backend, paged)
        # Each partial is the op on the whole cache restricted to the shard's tokens.
        for r, (s, n) in enumerate(bounds):
            a_out, a_lse = qsa_reference(_shard_alone(case, s, n), backend)
            assert torch.equal(outs[r], a_out) and torch.equal(lses[r], a_lse), (world, r)
        if empty is not None:
            r = empty[world]
            assert (lses[r] == -math.inf).all() and (outs[r] == 0).all()
        out, lse = merge_oracle(outs, lses)
        if "gate" in case:
            out = gated(out, case["gate"])
        assert_close(out, want, **OUT_TOL[dt])
        assert_close(lse, want_lse, **LSE_TOL)
        got, got_lse = sd.merge_shard_states(outs, lses, gate=case.get("gate"))
        assert_close(got, want, **OUT_TOL[dt])
        assert_close(got_lse, want_lse, **LSE_TOL)
        if name.endswith("holds-everything") and "gate" not in case:
            assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,q_len,k_len,dtype,heads,causal,cuts", XATTN_CASES)
def test_simulated_xattn_block_sparse(seed, q_len, k_len, dtype, heads, causal, cuts, device):
    if device == "cuda" and dtype != torch.bfloat16:
        pytest.skip("native CUDA block-sparse attention takes 16-bit inputs")
    # Head dim 64 on the GPU (the native kernel's smallest), 32 on the CPU.
    case = _on(xattn_case(seed, q_len, k_len, dtype, heads, d=32 if device == "cpu" else 64),
               device)
    want, want_lse = xattn_reference(case, causal, "native")
    for world in (2, 3):
        outs, lses = [], []
        for block_start, first, n in block_shards(k_len, cuts[world]):
            out, lse = sd.xattn_block_sparse_shard(
                case["q"], case["k"][first:first + n], case["v"][first:first + n],
                case["base_blockmask"], **xattn_shard_kwargs(case, causal, block_start))
            outs.append(out)
            lses.append(lse)
            if n == 0:
                assert (lse == -math.inf).all() and (out == 0).all()
        outs, lses = torch.stack(outs), torch.stack(lses)
        out, lse = merge_oracle(outs, lses)
        assert_close(out, want, **OUT_TOL[dtype])
        assert_close(lse, want_lse, **LSE_TOL)
        got, got_lse = sd.merge_shard_states(outs, lses)
        assert_close(got, want, **OUT_TOL[dtype])
        assert_close(got_lse, want_lse, **LSE_TOL)


def test_simulated_xattn_reference_backend():
    case = xattn_case(21, 200, 600, torch.float32, "mixed")
    want, want_lse = xattn_reference(case, True, "reference")
    outs, lses = [], []
    for block_start, first, n in block_shards(600, (2, 3)):
        out, lse = sd.xattn_block_sparse_shard(
            case["q"], case["k"][first:first + n], case["v"][first:first + n],
            case["base_blockmask"], backend="reference",
            **xattn_shard_kwargs(case, True, block_start))
        outs.append(out)
        lses.append(lse)
    out, lse = merge_oracle(torch.stack(outs), torch.stack(lses))
    assert_close(out, want, **OUT_TOL[torch.float32])
    assert_close(lse, want_lse, **LSE_TOL)


def _on(case, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


# The QSA cases native CUDA takes (D = 256; padded queries with padded K/V, flattened queries
# with paged K/V): checked on the GPU against the reference backend.
GPU_QSA_CASES = [c for c in QSA_CASES if c[1] == "decode" or c[4]]


@needs_cuda
@pytest.mark.parametrize("name,kind,gate,seq_lens,paged,cuts,empty",
                         GPU_QSA_CASES, ids=[c[0] for c in GPU_QSA_CASES])
def test_simulated_qsa_attention_on_the_gpu(name, kind, gate, seq_lens, paged, cuts, empty):
    # One GPU, ranks simulated by shards: each shard's native partial against the reference of
    # the whole cache restricted to its tokens, the merge against the reference of the whole.
    for world in (2, 3):
        bounds = shard_bounds(48, cuts[world])
        case = qsa_case(kind, 7, torch.bfloat16, gate, seq_lens, d=256)
        want, want_lse = qsa_reference(case, "reference")
        outs, lses = _qsa_partials(case, bounds, "native", paged, device="cuda")
        for r, (s, n) in enumerate(bounds):
            a_out, a_lse = qsa_reference(_shard_alone(case, s, n), "reference")
            assert_close(outs[r].cpu(), a_out, **OUT_TOL[torch.bfloat16])
            assert_close(lses[r].cpu(), a_lse, **LSE_TOL)
        got, got_lse = sd.merge_shard_states(outs, lses,
                                             gate=None if gate is None else case["gate"].cuda())
        assert_close(got.cpu(), want, **OUT_TOL[torch.bfloat16])
        assert_close(got_lse.cpu(), want_lse, **LSE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3])
def test_simulated_qsa_prefill_rows(device, world):
    # Every rank's piece of the context-parallel prefill (its zigzag rows against the whole
    # K/V) gives the single-process pipeline's rows: bitwise on the CPU; on the GPU within
    # rounding (which kernel and how many splits run follows the call's row count).
    total, topk = 600, 16
    case = _on(cp_qsa_case(31, total, d=32 if device == "cpu" else 256), device)
    want, want_lse = cp_qsa_single_process(case, topk, "native")
    for own in sd.zigzag_ranges(total, world, align=4):
        out, lse = sd.qsa_prefill_rows(
            _rows(case["query"], own), _rows(case["q_idx"], own), case["key"], case["value"],
            case["block_keys"], ranges=own, topk=topk, gate=_rows(case["gate"], own),
            return_lse=True, scale=0.3)
        if device == "cpu":
            assert torch.equal(out, _rows(want, own)) and torch.equal(lse, _rows(want_lse, own))
        else:
            assert_close(out, _rows(want, own), **OUT_TOL[torch.bfloat16])
            assert_close(lse, _rows(want_lse, own), **LSE_TOL)


def random_ranges(total, world, align, seed):
    """A random split of 0 .. total - 1 into pieces on the `align` grid, dealt to `world`
    ranks in random order (a rank may get none, or several not in sequence order)."""
    g = _gen(seed)
    cuts = sorted({int(c) * align for c in torch.randint(1, max(2, total // align), (6,),
                                                         generator=g)} - {0})
    edges = [0, *[c for c in cuts if c < total], total]
    pieces = [(a, b - a) for a, b in zip(edges, edges[1:])]
    owner = torch.randint(0, world, (len(pieces),), generator=g).tolist()
    order = torch.randperm(len(pieces), generator=g).tolist()
    return [[pieces[i] for i in order if owner[i] == r] for r in range(world)]


@pytest.mark.parametrize("seed", range(4))
def test_simulated_qsa_prefill_rows_on_random_ranges(seed):
    # Any ranges on the block grid, not only zigzag ones: every rank's rows are the
    # single-process rows, bit for bit (CPU backend).
    total, topk = 301, 8
    case = cp_qsa_case(50 + seed, total)
    want, want_lse = cp_qsa_single_process(case, topk, "native")
    for own in random_ranges(total, 3, 4, seed):
        out, lse = sd.qsa_prefill_rows(
            _rows(case["query"], own) if own else case["query"][:0],
            _rows(case["q_idx"], own) if own else case["q_idx"][:0], case["key"],
            case["value"], case["block_keys"], ranges=own, topk=topk,
            gate=_rows(case["gate"], own) if own else case["gate"][:0], return_lse=True,
            scale=0.3)
        if own:
            assert torch.equal(out, _rows(want, own)) and torch.equal(lse, _rows(want_lse, own))
        else:
            assert out.shape[0] == 0


def test_prefill_rows_refuse_what_they_set():
    case = cp_qsa_case(3, 64)
    own = [(0, 64)]
    args = (case["query"], case["q_idx"], case["key"], case["value"], case["block_keys"])
    for name, value in (("query_positions", torch.zeros(1, 64, dtype=torch.int32)),
                        ("block_indices", torch.zeros(1, 64, 8, dtype=torch.int32)),
                        ("token_indices", torch.zeros(1, 64, 35, dtype=torch.int32))):
        with pytest.raises(ValueError, match=f"^{name}: set by the context-parallel prefill"):
            sd.qsa_prefill_rows(*args, ranges=own, topk=8, **{name: value})
    with pytest.raises(ValueError, match="^causal"):
        sd.xattn_prefill_rows(torch.zeros(1, 2, 128, 64), torch.zeros(1, 2, 128, 64),
                              torch.zeros(1, 2, 128, 64), 8, ranges=own, causal=False)


@pytest.mark.parametrize("seed", range(2))
def test_simulated_xattn_prefill_rows_on_random_ranges(seed):
    total = 1000
    g = _gen(60 + seed)
    q, k, v = (_randn(shape, torch.bfloat16, g)
               for shape in ((1, 4, total, 64), (1, 2, total, 64), (1, 2, total, 64)))
    want = sparse_attn.Xattention_prefill(q, k, v, 8, threshold=0.9)
    for own in random_ranges(total, 2, 128, seed):
        if own:
            got = sd.xattn_prefill_rows(_rows(q, own, 2), k, v, 8, ranges=own, threshold=0.9)
            assert torch.equal(got, _rows(want, own, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3])
def test_simulated_xattn_prefill_rows(device, world):
    total = 1000
    g = _gen(41)
    q, k, v = (_randn(shape, torch.bfloat16, g).to(device)
               for shape in ((1, 4, total, 64), (1, 2, total, 64), (1, 2, total, 64)))
    want = sparse_attn.Xattention_prefill(q, k, v, 8, threshold=0.9)
    for own in sd.zigzag_ranges(total, world, align=128):
        got = sd.xattn_prefill_rows(_rows(q, own, 2), k, v, 8, ranges=own, threshold=0.9)
        if device == "cpu":
            assert torch.equal(got, _rows(want, own, 2))
        else:
            assert_close(got, _rows(want, own, 2), **OUT_TOL[torch.bfloat16])


def test_shard_arguments_are_checked():
    case = qsa_case("decode", 1)
    k_sh, v_sh, _ = key_shard(case, 0, 20)
    args = (case["query"], k_sh, v_sh, case["token_indices"])
    with pytest.raises(ValueError, match="query_positions"):
        sd.qsa_sparse_attention_shard(*args, shard_start=0, shard_len=20)
    with pytest.raises(ValueError, match="gate"):
        sd.qsa_sparse_attention_shard(*args, shard_start=0, shard_len=20,
                                      query_positions=case["query_positions"],
                                      gate=torch.zeros(3, 1, 4, dtype=torch.bfloat16))
    with pytest.raises(sparse_attn.NotSupportedError, match="selected_kv_indices"):
        sd.qsa_sparse_attention_shard(*args, shard_start=0, shard_len=20,
                                      selected_kv_indices=case["token_indices"])
    x = xattn_case(1, 200, 600, torch.float32)
    with pytest.raises(ValueError, match="k_shard"):  # not whole blocks, not the last shard
        sd.xattn_block_sparse_shard(x["q"], x["k"][:100], x["v"][:100], x["base_blockmask"],
                                    **xattn_shard_kwargs(x, True, 0))
    with pytest.raises(ValueError, match="base_blockmask"):
        sd.xattn_block_sparse_shard(x["q"], x["k"][:128], x["v"][:128],
                                    x["base_blockmask"][..., :3],
                                    **xattn_shard_kwargs(x, True, 0))


@pytest.mark.parametrize("total,world,align", [(1000, 2, 4), (4096, 4, 128), (1000, 3, 128),
                                               (0, 2, 4), (5, 4, 4)])
def test_zigzag_ranges_cover_the_sequence_and_balance_causal_work(total, world, align):
    ranges = sd.zigzag_ranges(total, world, align=align)
    assert len(ranges) == world and all(len(own) == 2 for own in ranges)
    pieces = sorted(p for own in ranges for p in own if p[1])
    end = 0
    for start, length in pieces:
        assert start == end and (start % align == 0)
        end = start + length
    assert end == total

    def work(own):  # causal key-row pairs of the rows in own
        return sum((s + n) * (s + n + 1) // 2 - s * (s + 1) // 2 for s, n in own)

    if total % (2 * world * align) == 0 and total:
        assert len({work(own) for own in ranges}) == 1
    with pytest.raises(ValueError, match="^world"):
        sd.zigzag_ranges(10, 0)
    with pytest.raises(TypeError, match="^align"):
        sd.zigzag_ranges(10, 2, align=1.5)


# --------------------------------------------------------------------------------------------
# Process groups of 2 and 3 ranks (gloo)


def _run_topk_suite(rank, world, group):
    for seed, shape, nb, k, cuts, perm in TOPK_CASES:
        scores = topk_case(seed, shape, nb)
        want = sparse_attn.qsa_topk_blocks(scores, k)
        bounds = shard_bounds(nb, cuts[world])
        s, n = bounds[rank if perm is None else perm[world][rank]]
        got = sd.qsa_topk_blocks_sharded(scores[..., s:s + n].contiguous(), k, block_offset=s,
                                         group=group)
        assert torch.equal(got, want), (seed, world, rank)
    if world == 3:
        # A subgroup: ranks 1 and 2 shard one case between them, rank 0 stays out.
        sub = dist.new_group([1, 2])
        if rank:
            seed, shape, nb, k, cuts, _ = TOPK_CASES[1]
            scores = topk_case(seed, shape, nb)
            s, n = shard_bounds(nb, cuts[2])[dist.get_rank(sub)]
            got = sd.qsa_topk_blocks_sharded(scores[..., s:s + n].contiguous(), k,
                                             block_offset=s, group=sub)
            assert torch.equal(got, sparse_attn.qsa_topk_blocks(scores, k))


def _same_on_every_rank(t, group):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t.contiguous(), group=group)
    assert all(torch.equal(x, gathered[0]) for x in gathered)


def _run_qsa_suite(rank, world, group):
    for name, kind, gate, seq_lens, paged, cuts, empty in QSA_CASES:
        bounds = shard_bounds(48, cuts[world])
        case = qsa_case(kind, 7, torch.bfloat16, gate, seq_lens)
        if empty is not None:
            case = without_shard_tokens(case, *bounds[empty[world]])
        want, want_lse = qsa_reference(case, "native")
        s, n = bounds[rank]
        k_sh, v_sh, layout = key_shard(case, s, n, paged=paged, seed=rank)
        kwargs = {k: v for k, v in case.items() if k not in ("query", "key", "value",
                                                             "token_indices")}
        results = []
        for _ in range(2):  # reruns are bitwise equal
            results.append(sd.qsa_sparse_attention_sharded(
                case["query"], k_sh, v_sh, case["token_indices"], shard_start=s, shard_len=n,
                group=group, return_lse=True, **kwargs, **layout))
        (out, lse), (out2, lse2) = results
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        assert out.shape == case["query"].shape and lse.shape == case["query"].shape[:-1]
        assert_close(out, want, **OUT_TOL[torch.bfloat16])
        assert_close(lse, want_lse, **LSE_TOL)
        if name.endswith("holds-everything"):
            assert torch.equal(out, want) and torch.equal(lse, want_lse), name
        _same_on_every_rank(out, group)
        # out= is written and returned; without return_lse only the output comes back.
        dest = torch.empty_like(case["query"])
        got = sd.qsa_sparse_attention_sharded(
            case["query"], k_sh, v_sh, case["token_indices"], shard_start=s, shard_len=n,
            group=group, out=dest, **kwargs, **layout)
        assert got is dest and torch.equal(dest, out)
    # One rank's malformed shard: that rank raises its error after taking part in the gather
    # (none is left waiting), and the others' merged rows are NaN, not quietly wrong.
    case = qsa_case("decode", 7, torch.bfloat16)
    s, n = shard_bounds(48, QSA_CASES[0][5][world])[rank]
    k_sh, v_sh, _ = key_shard(case, s, n)
    call = dict(query_positions=case["query_positions"], shard_start=s, shard_len=n,
                group=group, return_lse=True)
    if rank == 1:
        with pytest.raises((ValueError, TypeError), match="^key"):
            sd.qsa_sparse_attention_sharded(case["query"], k_sh.float(), v_sh,
                                            case["token_indices"], **call)
    else:
        out, lse = sd.qsa_sparse_attention_sharded(case["query"], k_sh, v_sh,
                                                   case["token_indices"], **call)
        assert out.isnan().all() and lse.isnan().all()
    if world == 3:
        # A subgroup of ranks 0 and 2 (group ranks 0 and 1) shards one case, rank 1 stays out.
        sub = dist.new_group([0, 2])
        if rank != 1:
            case = qsa_case("decode", 7, torch.bfloat16, "per_head")
            s, n = shard_bounds(48, (20,))[dist.get_rank(sub)]
            k_sh, v_sh, _ = key_shard(case, s, n)
            out, lse = sd.qsa_sparse_attention_sharded(
                case["query"], k_sh, v_sh, case["token_indices"], shard_start=s, shard_len=n,
                group=sub, return_lse=True, query_positions=case["query_positions"],
                gate=case["gate"], scale=case["scale"])
            want, want_lse = qsa_reference(case, "native")
            assert_close(out, want, **OUT_TOL[torch.bfloat16])
            assert_close(lse, want_lse, **LSE_TOL)


def _run_xattn_suite(rank, world, group):
    for seed, q_len, k_len, dtype, heads, causal, cuts in XATTN_CASES:
        case = xattn_case(seed, q_len, k_len, dtype, heads)
        want, want_lse = xattn_reference(case, causal, "native")
        block_start, first, n = block_shards(k_len, cuts[world])[rank]
        out, lse = sd.xattn_block_sparse_sharded(
            case["q"], case["k"][first:first + n], case["v"][first:first + n],
            case["base_blockmask"], group=group, return_lse=True,
            **xattn_shard_kwargs(case, causal, block_start))
        assert_close(out, want, **OUT_TOL[dtype])
        assert_close(lse, want_lse, **LSE_TOL)
        _same_on_every_rank(out, group)


def cp_qsa_case(seed, total, d=32):
    """One request of `total` tokens, every input of the QSA prefill pipeline per token."""
    g = _gen(seed)
    hq, hkv = 4, 2
    return dict(query=_randn((total, hq, d), torch.bfloat16, g),
                key=_randn((total, hkv, d), torch.bfloat16, g),
                value=_randn((total, hkv, d), torch.bfloat16, g),
                q_idx=_randn((total, 4, 128), torch.bfloat16, g),
                block_keys=_randn((total // 4, 128), torch.bfloat16, g),
                gate=_randn((total, hq), torch.bfloat16, g, 2.0))


def cp_qsa_single_process(case, topk, backend):
    """The pipeline on one process, every row: (out, lse)."""
    total = case["query"].shape[0]
    positions = torch.arange(total, dtype=torch.int32, device=case["query"].device)[None]
    _, tokens = sparse_attn.qsa_indexer_select(
        case["q_idx"][None], case["block_keys"][None], topk, query_positions=positions,
        return_tokens=True, backend=backend)
    out, lse = sparse_attn.qsa_sparse_attention(
        case["query"][None], case["key"][None], case["value"][None], tokens,
        query_positions=positions, gate=case["gate"][None], return_lse=True, scale=0.3,
        backend=backend)
    return out[0], lse[0]


def _rows(t, own, dim=0):
    return torch.cat([t.narrow(dim, s, n) for s, n in own], dim=dim)


def _run_context_parallel_suite(rank, world, group):
    # all_gather_sequence: uneven ranges, not in rank order, along an inner axis.
    x = torch.arange(2 * 3 * 23, dtype=torch.float32).view(2, 23, 3)
    ranges = [[(17, 6), (0, 5)], [(5, 12)], [(23, 0)]][:world]
    if world == 2:
        ranges[1] = [(5, 12)]
        ranges[0] = [(17, 6), (0, 5)]
    got = sd.all_gather_sequence(_rows(x, ranges[rank], 1), ranges, dim=1, group=group)
    assert torch.equal(got, x)
    with pytest.raises(ValueError, match="^ranges: expected disjoint"):
        bad = [[(0, 6)], [(5, 18)], [(23, 0)]][:world]
        sd.all_gather_sequence(_rows(x, bad[rank], 1), bad, dim=1, group=group)
    with pytest.raises(ValueError, match="^local: expected"):
        sd.all_gather_sequence(x[:, :1], ranges, dim=1, group=group)

    for total, topk in ((600, 16), (1001, 8)):
        case = cp_qsa_case(31, total)
        own = sd.zigzag_ranges(total, world, align=4)
        mine = own[rank]
        for backend in ("native", "reference"):
            want, want_lse = cp_qsa_single_process(case, topk, backend)
            out, lse = sd.qsa_prefill_context_parallel(
                _rows(case["query"], mine), _rows(case["key"], mine),
                _rows(case["value"], mine), _rows(case["q_idx"], mine),
                _rows(case["block_keys"], [(s // 4, n // 4) for s, n in mine]), ranges=own,
                topk=topk, group=group, gate=_rows(case["gate"], mine), return_lse=True,
                scale=0.3, backend=backend, indexer_options={"backend": backend})
            assert torch.equal(out, _rows(want, mine)), (total, backend, rank)
            assert torch.equal(lse, _rows(want_lse, mine)), (total, backend, rank)
    with pytest.raises(ValueError, match=r"^ranges\[0\]: expected starts and lengths"):
        shifted = [[(0, 2)], *[[(2, 598)] if r == 1 else [] for r in range(1, world)]]
        sd.qsa_prefill_context_parallel(
            case["query"][:2], case["key"][:2], case["value"][:2], case["q_idx"][:2],
            case["block_keys"][:0], ranges=shifted, group=group)

    # A malformed input on one rank makes every rank raise (no rank is left in a collective).
    case = cp_qsa_case(31, 600)
    own = sd.zigzag_ranges(600, world, align=4)
    mine = own[rank]
    args = dict(query=_rows(case["query"], mine), key=_rows(case["key"], mine),
                value=_rows(case["value"], mine), q_idx=_rows(case["q_idx"], mine),
                block_keys=_rows(case["block_keys"], [(s // 4, n // 4) for s, n in mine]))
    last = world - 1
    broken = [
        ("key", 1, lambda a: {**a, "key": a["key"][1:]}, own),
        ("value", 0, lambda a: {**a, "value": a["value"].float()}, own),
        ("block_keys", last, lambda a: {**a, "block_keys": None}, own),
        ("ranges", 0, lambda a: a, [list(reversed(r)) for r in own]),
    ]
    for name, culprit, breaks, ranges_ in broken:
        mine_args = breaks(args) if rank == culprit else args
        mine_ranges = ranges_ if rank == culprit else own
        with pytest.raises((ValueError, TypeError), match=rf"^{name}: "):
            sd.qsa_prefill_context_parallel(**mine_args, ranges=mine_ranges, topk=16,
                                            group=group)

    for total in (1024, 1000):
        g = _gen(41)
        q = _randn((1, 4, total, 64), torch.bfloat16, g)
        k = _randn((1, 2, total, 64), torch.bfloat16, g)
        v = _randn((1, 2, total, 64), torch.bfloat16, g)
        own = sd.zigzag_ranges(total, world, align=128)
        mine = own[rank]
        for backend in ("native", "reference"):
            want = sparse_attn.Xattention_prefill(q, k, v, 8, threshold=0.9, backend=backend)
            got = sd.xattn_prefill_context_parallel(
                _rows(q, mine, 2), _rows(k, mine, 2), _rows(v, mine, 2), 8, ranges=own,
                group=group, threshold=0.9, backend=backend)
            assert torch.equal(got, _rows(want, mine, 2)), (total, backend, rank)
    with pytest.raises(ValueError, match="^causal"):
        sd.xattn_prefill_context_parallel(_rows(q, mine, 2), _rows(k, mine, 2),
                                          _rows(v, mine, 2), 8, ranges=own, group=group,
                                          causal=False)
    # One rank's malformed shard (not whole blocks, not the last): that rank raises, the
    # others' rows are NaN.
    case = xattn_case(11, 200, 600, torch.bfloat16)
    block_start, first, n = block_shards(600, XATTN_CASES[0][6][world])[rank]
    n -= rank == 0
    args = (case["q"], case["k"][first:first + n], case["v"][first:first + n],
            case["base_blockmask"])
    kwargs = dict(group=group, return_lse=True, **xattn_shard_kwargs(case, True, block_start))
    if rank == 0:
        with pytest.raises(ValueError, match="^k_shard"):
            sd.xattn_block_sparse_sharded(*args, **kwargs)
    else:
        out, lse = sd.xattn_block_sparse_sharded(*args, **kwargs)
        assert out.isnan().all() and lse.isnan().all()


SUITES = {"topk": _run_topk_suite, "qsa": _run_qsa_suite, "xattn": _run_xattn_suite,
          "context_parallel": _run_context_parallel_suite}


def _worker(rank, world, port, suite):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        SUITES[suite](rank, world, None)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_method():
    # A forkserver starts one clean interpreter (torch and sparse_attn preloaded, no OpenMP
    # thread pool yet) and forks every rank from it: a rank costs a fork instead of an
    # interpreter start (~3 s of torch import each on CI's 2 cores), and forking the test
    # process itself (whose OpenMP pool other tests have started) is avoided.
    if "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "sparse_attn"])
        return "forkserver"
    return "spawn"


def run_world(world, suite):
    torch.multiprocessing.start_processes(_worker, args=(world, _free_port(), suite),
                                          nprocs=world, join=True, start_method=_start_method())


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_world_topk(world):
    run_world(world, "topk")


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_world_qsa_attention(world):
    run_world(world, "qsa")


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_world_xattn_block_sparse(world):
    run_world(world, "xattn")


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_world_context_parallel_prefill(world):
    run_world(world, "context_parallel")


@needs_gloo
def test_distributed_bench_smoke():
    # bench/distributed_bench.py on the CPU (worlds 1 and 2 on gloo): it runs; world 2's
    # sampled prefill rows equal world 1's (the CPU backend is row-independent), its decode
    # rows within the merge's rounding (each partial is rounded to bf16 before the merge).
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "distributed_bench.py"),
                           "--smoke"], capture_output=True, text=True, timeout=600, check=True)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith(("| qsa", "| xattn", "| decode"))]
    assert sorted((r[0].strip(), r[2].strip()) for r in rows) == \
        [("decode", "1"), ("decode", "2"), ("qsa", "1"), ("qsa", "2"), ("xattn", "1"),
         ("xattn", "2")], done.stdout
    for r in rows:
        if r[2].strip() == "2":
            assert float(r[-1]) <= (1e-2 if r[0].strip() == "decode" else 0.0), done.stdout
