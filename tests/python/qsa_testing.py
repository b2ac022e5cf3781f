"""Shared helpers of the Python suite: devices, random inputs, comparisons, and independent
float64 torch computations of the QSA ops (written from docs/qsa.md and SPEC.md, not from
the code under test)."""

import math

import pytest
import torch

import sparse_attn

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")

# Every test that takes `device` runs on the CPU and, where there is a GPU, on CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def backends_for(device):
    """The backends a device runs: the reference everywhere, native on CUDA."""
    return ["reference"] if device == "cpu" else ["reference", "native"]


def call_native_or_skip(fn, backend):
    """Runs fn(); a NotSupportedError from the native backend skips the case with its
    message (a combination the native kernels do not cover yet), anything else propagates."""
    try:
        return fn()
    except sparse_attn.NotSupportedError as e:
        if backend == "reference":
            raise
        pytest.skip(f"native backend: {e}")


def randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype).to(device)


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def strided_copy(t, keep_rows=0, pad=3):
    """The same values as `t` in a non-contiguous view with a storage offset: every axis is
    embedded in a larger buffer (offset 1, room after), the last axis at stride 2. The first
    `keep_rows` axes are left unpadded, so that they still collapse into one row axis (the
    seed's zero-copy row view rule for query, indices, gate and out)."""
    big_shape = [s if i < keep_rows else s + pad for i, s in enumerate(t.shape)]
    big_shape[-1] = 2 * t.shape[-1] + pad
    big = torch.zeros(big_shape, dtype=t.dtype, device=t.device)
    index = tuple(slice(None) if i < keep_rows else slice(1, 1 + s)
                  for i, s in enumerate(t.shape[:-1])) + (slice(1, 1 + 2 * t.shape[-1], 2),)
    view = big[index]
    view.copy_(t)
    assert not view.is_contiguous() and view.storage_offset() > 0
    return view


def assert_close(out, ref, rtol, atol):
    """-inf/+inf/NaN positions match exactly; finite values within tolerance."""
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    for name, fn in (("-inf", lambda x: x == -math.inf), ("+inf", lambda x: x == math.inf),
                     ("nan", torch.isnan)):
        mismatch = fn(out) != fn(ref)
        if mismatch.any():
            where = tuple(mismatch.nonzero()[0].tolist())
            raise AssertionError(f"{name} positions differ, first at {where}: got {out[where]}, "
                                 f"expected {ref[where]}")
    finite = torch.isfinite(ref)
    err = (out - ref).abs() - (atol + rtol * ref.abs())
    err = torch.where(finite, err, torch.zeros_like(err))
    if (err > 0).any():
        where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(f"values differ, worst at {where}: got {out[where].item()}, "
                             f"expected {ref[where].item()}")


# --------------------------------------------------------------------------------------------
# Indexer: score = scale * sum_h ReLU(q_h . k), -inf where the block's last token 4b + 3 is
# past the row's position.
# --------------------------------------------------------------------------------------------

def ref_relu_scores(q, k, scale):
    """q [..., H, D], k [N, D] -> [..., N] in float64."""
    dots = torch.einsum("...hd,nd->...hn", q.double().cpu(), k.double().cpu())
    return dots.clamp_min(0).sum(-2) * scale


def ref_block_visible(positions, num_blocks):
    """positions [...] -> bool [..., num_blocks]: block b visible iff 4b + 3 <= position."""
    blocks = torch.arange(num_blocks)
    return 4 * blocks + 3 <= positions.long().cpu()[..., None]


def ref_indexer_padded(q, k, scale, positions=None, seq_lens_q=None):
    B, Q = q.shape[:2]
    N = k.shape[1]
    out = torch.stack([ref_relu_scores(q[b], k[b], scale) for b in range(B)])
    if positions is None:
        positions = torch.arange(Q).expand(B, Q)
    mask = ref_block_visible(positions, N)
    if seq_lens_q is not None:
        mask &= (torch.arange(Q)[None, :] < seq_lens_q.long().cpu()[:, None])[..., None]
    return out.masked_fill(~mask, -math.inf)


def ref_mqa_prefill(q, k, row_starts, row_ends, scale):
    k2 = k.reshape(k.shape[0], k.shape[-1])
    out = ref_relu_scores(q, k2, scale)
    cols = torch.arange(k.shape[0])
    mask = (cols[None, :] >= row_starts.long().cpu()[:, None]) & \
        (cols[None, :] < row_ends.long().cpu()[:, None])
    return out.masked_fill(~mask, -math.inf)


def ref_mqa_decode(q, k_cache, page_table, context_lens, max_model_len, scale):
    """[B * R, max_model_len]: request b's query row r (q [B, H, D] is R = 1, or
    [B, R, H, D]) is row b * R + r and sees context_lens[b, r] compressed keys (context_lens
    [B, R], or [B] when R = 1)."""
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    R = q.shape[1] if q.dim() == 4 else 1
    q4 = q.reshape(B, R, H, D)
    lens = context_lens.long().cpu().reshape(B, R)
    pages, page_size = k_cache.shape[:2]
    kc = k_cache.reshape(pages, page_size, -1)
    out = torch.full((B * R, max_model_len), -math.inf, dtype=torch.float64)
    pt = page_table.long().cpu()
    for b in range(B):
        for r in range(R):
            for c in range(min(max_model_len, int(lens[b, r]))):
                if c // page_size >= pt.shape[1]:
                    continue
                page = int(pt[b, c // page_size])
                if page < 0 or page >= pages:
                    continue
                out[b * R + r, c] = ref_relu_scores(q4[b, r], kc[page, c % page_size][None],
                                                    scale)[0]
    return out


# --------------------------------------------------------------------------------------------
# Sparse attention: out[r, h] = softmax_j(scale * q[r, h] . K[j, h // G]) V[j, h // G] over the
# row's valid selected tokens j (0 <= j < seq_len_k, j <= position, page present; duplicates
# each count); rows without one give zero output and LSE -inf. Gate: round(round(attn) *
# sigmoid(gate)).
# --------------------------------------------------------------------------------------------

# Oracles' K/V of a query row (for ref_attention_rows' kv_of_row): the row's request's keys and
# values as float64 on the CPU, with the per-key "present" flags (a paged slot whose page is
# -1 or out of range is absent).
def padded_kv_of(key, value, b_of_row):
    def kv(r):
        b = b_of_row[r]
        return key[b].cpu(), value[b].cpu(), [True] * key.shape[1]
    return kv


def paged_kv_of(key, value, table, b_of_row):
    pages, page_size = key.shape[:2]
    max_pages = table.shape[1]

    def kv(r):
        b = b_of_row[r]
        L = max_pages * page_size
        K = torch.zeros((L, *key.shape[2:]), dtype=torch.float64)
        V = torch.zeros_like(K)
        present = [False] * L
        for slot in range(max_pages):
            page = int(table[b, slot])
            if 0 <= page < pages:
                K[slot * page_size:(slot + 1) * page_size] = key[page].double().cpu()
                V[slot * page_size:(slot + 1) * page_size] = value[page].double().cpu()
                for t in range(slot * page_size, (slot + 1) * page_size):
                    present[t] = True
        return K, V, present
    return kv


def ref_attention_rows(q, ids, kv_of_row, positions, seq_lens_k, active, scale, gate=None,
                       out_dtype=None, causal=True):
    """q [R, Hq, D]; ids [R, W]; kv_of_row(r) -> (K [L, Hkv, D], V, present bool [L]) for
    the row's request; positions, seq_lens_k, active: per-row lists. Returns (out rounded to
    out_dtype then gated, lse) in float64."""
    q = q.double().cpu()
    R, Hq, D = q.shape
    out = torch.zeros((R, Hq, D), dtype=torch.float64)
    lse = torch.full((R, Hq), -math.inf, dtype=torch.float64)
    ids = ids.long().cpu()
    for r in range(R):
        if not active[r]:
            continue
        K, V, present = kv_of_row(r)
        group = Hq // K.shape[1]
        sel = [t for t in ids[r].tolist()
               if 0 <= t < seq_lens_k[r] and (not causal or t <= positions[r]) and present[t]]
        if not sel:
            continue
        idx = torch.tensor(sel)
        for h in range(Hq):
            ks = K[idx, h // group].double()
            vs = V[idx, h // group].double()
            logits = scale * (ks @ q[r, h])
            lse[r, h] = torch.logsumexp(logits, 0)
            out[r, h] = torch.softmax(logits, 0) @ vs
    if out_dtype is not None:
        out = out.to(out_dtype).double()
    if gate is not None:
        g = torch.sigmoid(gate.double().cpu())
        if g.dim() == 2:
            g = g[..., None]
        out = (out * g)
        if out_dtype is not None:
            out = out.to(out_dtype).double()
    return out, lse


def expand_blocks(blocks, positions):
    """The SPEC's expansion: each kept block b (b >= 0 and 4b + 3 <= p) -> 4b..4b+3 in input
    order, then the tail 4*((p+1)//4) .. p (none for p < 0); valid ids to the front, -1
    after; width 4 * nb + 3. Returns (token ids, kept block ids padded with -1)."""
    rows, nb = blocks.shape
    tokens = torch.full((rows, 4 * nb + 3), -1, dtype=torch.int32)
    kept = torch.full((rows, nb), -1, dtype=torch.int32)
    for r in range(rows):
        p = int(positions[r])
        ids = [b for b in blocks[r].tolist() if b >= 0 and 4 * b + 3 <= p]
        kept[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        tail = range(4 * ((p + 1) // 4), p + 1) if p >= 0 else range(0)
        toks = [4 * b + t for b in ids for t in range(4)] + list(tail)
        tokens[r, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
    return tokens, kept


def ref_merge(partial_out, partial_lse):
    """docs/merge.md in float64: partial_out [N, rows, heads, dim], partial_lse [N, rows, heads]
    -> (out [rows, heads, dim], lse [rows, heads]). Partials with LSE -inf are not read (their
    out may be NaN); a row with no finite LSE gives 0 and -inf; a NaN or +inf LSE gives NaN."""
    po = torch.as_tensor(partial_out).detach().to("cpu", torch.float64)
    lse = torch.as_tensor(partial_lse).detach().to("cpu", torch.float64)
    live = torch.isfinite(lse)
    m = torch.where(live, lse, -math.inf).amax(0)
    empty = m == -math.inf
    w = torch.where(live, torch.exp(lse - torch.where(empty, 0.0, m)), 0.0)
    z = w.sum(0)
    out = (w[..., None] * torch.where(live[..., None], po, 0.0)).sum(0) / \
        torch.where(empty, 1.0, z)[..., None]
    merged = torch.where(empty, -math.inf, m + torch.log(torch.where(empty, 1.0, z)))
    poisoned = (torch.isnan(lse) | (lse == math.inf)).any(0)
    out[poisoned] = math.nan
    merged[poisoned] = math.nan
    return out, merged
