"""Independent float64 statements of the XAttention ops (include/sparse_attn/xattn.h and the
seed's algorithm guide), for the Python suite."""

import math

import torch


def cdiv(a, b):
    return (a + b - 1) // b


def ref_estimate_sums(q, k, block_size, stride, norm=1.0, causal=True):
    """Antidiagonal scores of inverse-interleaved queries and forward-interleaved keys,
    softmax over the key groups visible to each query group, summed per (query block, key
    block). q [B, Hq, Lq, D], k [B, Hkv, Lk, D] -> FP64 [B, Hq, q_blocks, k_blocks]."""
    q = q.double().cpu()
    k = k.double().cpu()
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    S = stride
    qg, kg = cdiv(Lq, S), cdiv(Lk, S)
    qp = torch.zeros((B, Hq, qg * S, D), dtype=torch.float64)
    qp[:, :, :Lq] = q
    kp = torch.zeros((B, Hkv, kg * S, D), dtype=torch.float64)
    kp[:, :, :Lk] = k
    q_res = torch.cat([qp[:, :, S - 1 - t::S] for t in range(S)], dim=-1)
    k_res = torch.cat([kp[:, :, t::S] for t in range(S)], dim=-1)
    k_res = k_res.repeat_interleave(Hq // Hkv, dim=1)
    scores = q_res @ k_res.transpose(-1, -2) / (math.sqrt(D) * S * norm)
    if causal:
        offset = Lk - Lq
        for g in range(qg):
            last = offset + min(g * S + S - 1, Lq - 1)
            scores[:, :, g, min(last // S + 1, kg):] = -math.inf
    probs = torch.softmax(scores, dim=-1)
    gpb = block_size // S
    qb, kb = cdiv(Lq, block_size), cdiv(Lk, block_size)
    sums = torch.zeros((B, Hq, qb, kb), dtype=torch.float64)
    for i in range(qb):
        rows = probs[:, :, i * gpb:min((i + 1) * gpb, qg)].sum(2)
        for j in range(kb):
            sums[:, :, i, j] = rows[..., j * gpb:min((j + 1) * gpb, kg)].sum(-1)
    return sums


def ref_select(sums, thresholds, causal=True, keep_sink=False, keep_recent=False, q_len=None,
               k_len=None, block_size=128):
    """The selection rule on given sums [B, H, q_blocks, k_blocks] (thresholds: one per
    head): forced blocks first (ascending), then by descending sum (ties: lower index), kept
    while the sum before the block is below threshold * the eligible total."""
    B, H, qbn, kbn = sums.shape
    q_len = qbn * block_size if q_len is None else q_len
    k_len = kbn * block_size if k_len is None else k_len
    offset = k_len - q_len
    v = sums.double().cpu()
    mask = torch.zeros(sums.shape, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(qbn):
                last_row = min((i + 1) * block_size, q_len) - 1
                diag = (offset + last_row) // block_size
                eligible = diag + 1 if causal else kbn
                forced = set()
                if causal or keep_recent:
                    forced.add(diag)
                if keep_sink:
                    forced.add(0)
                row = v[b, h, i].tolist()
                others = sorted((j for j in range(eligible) if j not in forced),
                                key=lambda j: (-row[j], j))
                order = sorted(forced) + others
                if thresholds[h] >= 1.0:
                    for j in range(eligible):
                        mask[b, h, i, j] = True
                    continue
                required = thresholds[h] * sum(row[j] for j in order)
                before = 0.0
                for j in order:
                    if j not in forced and not before < required:
                        break
                    mask[b, h, i, j] = True
                    before += row[j]
    return mask


def ref_block_sparse(q, k, v, cu_q, cu_k, head_mask_type, streaming_info, blockmask, scale,
                     causal, block=128):
    """Varlen block-sparse attention in float64: q [total_q, Hq, D], k/v [total_k, Hkv, D].
    Returns (out, lse [total_q, Hq])."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    total_q, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((total_q, Hq), -math.inf, dtype=torch.float64)
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        kb_n = cdiv(lk, block)
        rows = torch.arange(lq)[:, None]
        keys = torch.arange(lk)[None, :]
        q_block, k_block = rows // block, keys // block
        last_row = torch.clamp((q_block + 1) * block, max=lq) - 1
        diag = (lk - lq + last_row) // block if causal else torch.full_like(q_block, kb_n - 1)
        for h in range(Hq):
            t = head_mask_type[h]
            allowed = torch.ones((lq, lk), dtype=torch.bool)
            if causal:
                allowed &= keys <= lk - lq + rows
            if t == 1:
                s = sum(1 for x in head_mask_type[:h] if x == 1)
                allowed &= blockmask[b, s].cpu()[q_block, k_block]
            elif t == -1:
                sink, local = streaming_info[2 * h], streaming_info[2 * h + 1]
                allowed &= (k_block < sink) | ((k_block > diag - local) & (k_block <= diag))
            qs = q[cu_q[b]:cu_q[b + 1], h]
            ks = k[cu_k[b]:cu_k[b + 1], h // G]
            vs = v[cu_k[b]:cu_k[b + 1], h // G]
            logits = (scale * qs @ ks.T).masked_fill(~allowed, -math.inf)
            row_lse = torch.logsumexp(logits, -1)
            probs = torch.exp(logits - row_lse[:, None]).nan_to_num(0.0)
            lse[cu_q[b]:cu_q[b + 1], h] = row_lse
            out[cu_q[b]:cu_q[b + 1], h] = probs @ vs
    return out, lse
