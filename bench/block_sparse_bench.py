"""Native block-sparse attention (XAttention's attention step) against its baselines, measured
in the same process (issue 12):

dense: causal attention with every block kept (head_mask_type all 0), bf16, 8K / 32K / 128K
    tokens, 32/8/128 and 24/2/256 heads, against cuDNN SDPA (SDPBackend.CUDNN_ATTENTION).
sparse: random kept blocks at 30% and 10% of the causal 128x128 blocks (the diagonal always
    kept, one draw per head), 32K and 128K, against FlexAttention (torch.compile(flex_attention)
    with BlockMask.from_kv_blocks of the same blocks).
chunk: one chunk of 128 query rows against 32K / 128K keys, every block kept, not causal,
    32/8/128 (a chunked prefill's last chunk: 32 work tiles, so the keys are split), against
    cuDNN SDPA on the same shape.

FLOPs count the (query, key) pairs each kernel must compute: the kept blocks, the diagonal
blocks half (causal), 4 * D flops per pair and head. Also measured: the GEMM ceiling (bf16
8192^3 through torch.matmul). Timing: CUDA events, L2 flushed before every timed run, median.
Ours and the baseline run in alternation, --rounds times (default 3), so a drift of the GPU's
clock in the run moves both; the ratio printed is the median of the rounds' ratios, and the
spread of our rounds is printed beside it.

Usage: PYTHONPATH=build/python:python python3 bench/block_sparse_bench.py [--quick] [--csv F]
       [--only SUBSTRING] [--no-baselines] [--skip-check] [--rounds R]
--only keeps the cases whose name contains SUBSTRING (e.g. dense_32k_32_8_128); --no-baselines
times ours alone (no cuDNN / FlexAttention, so no compile wait); --skip-check leaves out the
native-vs-reference check, for timing variants that are wrong on purpose (a stage left out).
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparse_attn
from cuda_timing import time_ms

BLOCK = 128


def gemm_ceiling():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup=3, reps=10)
    return 2 * 8192 ** 3 / ms / 1e9


def inputs(n, hq, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def causal_pairs(kept):
    """(query, key) pairs computed over kept blocks [H, QB, KB] of a square causal problem."""
    qb = kept.shape[-1]
    diag = torch.eye(qb, dtype=torch.bool, device=kept.device)
    full = (kept & ~diag).sum().item() * BLOCK * BLOCK
    return full + (kept & diag).sum().item() * BLOCK * (BLOCK + 1) // 2


def ours(q, k, v, n, head_types, mask):
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    return lambda: sparse_attn.block_sparse_attn_func(
        q, k, v, cu, cu, head_types, None, mask, n, n, 0.0, is_causal=True, out=out)


ROUNDS = 3


def rows_for(name, base_name, flops, gemm, n, ours_fn, base_fn):
    """Times ours (and the baseline, if given) in alternating rounds; one row per impl:
    (case, impl, median ms, TFLOP/s, GEMM ceiling, median ratio base / ours, ours' spread)."""
    reps = 3 if n > 65536 else 5
    t_ours, t_base = [], []
    for _ in range(ROUNDS):
        t_ours.append(time_ms(ours_fn, reps=reps))
        if base_fn is not None:
            t_base.append(time_ms(base_fn, warmup=1, reps=reps))
    ms = statistics.median(t_ours)
    spread = (max(t_ours) - min(t_ours)) / ms
    row = (name, "ours", ms, flops / ms / 1e9, gemm, None, spread)
    if base_fn is None:
        return [row]
    base = statistics.median(t_base)
    ratio = statistics.median(b / a for a, b in zip(t_ours, t_base))
    return [row, (name, base_name, base, flops / base / 1e9, gemm, ratio, spread)]


def cudnn_fn(q, k, v, hq, hkv, causal):
    """cuDNN SDPA on the same tensors: [1, H, L, D] views, K/V repeated to Hq heads."""
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    kt = kt.repeat_interleave(hq // hkv, dim=1)
    vt = vt.repeat_interleave(hq // hkv, dim=1)

    def fn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return fn


def dense_rows(n, hq, hkv, d, gemm, baselines=True):
    q, k, v = inputs(n, hq, hkv, d, n + d)
    flops = 4.0 * hq * d * n * (n + 1) / 2
    name = f"dense_{n // 1024}k_{hq}_{hkv}_{d}"
    base_fn = cudnn_fn(q, k, v, hq, hkv, True) if baselines else None
    return rows_for(name, "cudnn", flops, gemm, n, ours(q, k, v, n, [0] * hq, None), base_fn)


def chunk_rows(nq, nk, hq, hkv, d, gemm, baselines=True):
    g = torch.Generator(device="cuda").manual_seed(nq + nk)
    q = torch.randn(nq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu_q = torch.tensor([0, nq], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, nk], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    fn = lambda: sparse_attn.block_sparse_attn_func(  # noqa: E731
        q, k, v, cu_q, cu_k, [0] * hq, None, None, nq, nk, 0.0, is_causal=False, out=out)
    flops = 4.0 * hq * d * nq * nk
    name = f"chunk{nq}_{nk // 1024}k_{hq}_{hkv}_{d}"
    base_fn = cudnn_fn(q, k, v, hq, hkv, False) if baselines else None
    return rows_for(name, "cudnn", flops, gemm, nq, fn, base_fn)


def random_blocks(hq, qb, density, seed):
    """Per head: each causal block kept with probability `density`, the diagonal always."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    keep = torch.rand(hq, qb, qb, device="cuda", generator=g) < density
    causal = torch.ones(qb, qb, dtype=torch.bool, device="cuda").tril()
    keep = keep & causal
    keep |= torch.eye(qb, dtype=torch.bool, device="cuda")
    return keep


_flex = None


def flex_fn(q, k, v, keep, hq, hkv):
    global _flex
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    if _flex is None:
        _flex = torch.compile(flex_attention)
    n = q.shape[0]
    qb = keep.shape[-1]
    # The diagonal blocks are the partial ones (the causal mask_mod runs there); the other
    # kept blocks are full (no mask_mod), as a user who knows the structure would pass them.
    diag = torch.eye(qb, dtype=torch.bool, device="cuda").expand_as(keep)
    full = keep & ~diag

    def listing(blocks):
        counts = blocks.sum(-1, dtype=torch.int32).unsqueeze(0)  # [1, H, QB]
        # Listed block ids first (ascending): from_kv_blocks reads the first `counts`.
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts, order.unsqueeze(0)

    causal = lambda b, h, qi, ki: qi >= ki
    mask = BlockMask.from_kv_blocks(*listing(diag.contiguous()), *listing(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=causal, seq_lengths=(n, n))
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return lambda: _flex(qt, kt, vt, block_mask=mask, enable_gqa=hq != hkv)


def sparse_rows(n, hq, hkv, d, density, gemm, baselines=True):
    q, k, v = inputs(n, hq, hkv, d, n + d + int(density * 100))
    qb = n // BLOCK
    keep = random_blocks(hq, qb, density, n + hq)
    pairs = causal_pairs(keep)
    flops = 4.0 * d * pairs
    name = f"sparse{int(density * 100)}_{n // 1024}k_{hq}_{hkv}_{d}"
    base_fn = None
    if baselines:
        base_fn = flex_fn(q, k, v, keep, hq, hkv)
        base_fn()  # compiles outside the timed rounds
    return rows_for(name, "flex", flops, gemm, n, ours(q, k, v, n, [1] * hq, keep.unsqueeze(0)),
                    base_fn)


def check_once():
    """One small native-vs-reference check, so a broken build cannot print fast numbers."""
    q, k, v = inputs(1000, 4, 2, 128, 1)
    cu = torch.tensor([0, 1000], dtype=torch.int32, device="cuda")
    keep = random_blocks(4, 8, 0.4, 3).unsqueeze(0)
    got = sparse_attn.block_sparse_attn_func(q, k, v, cu, cu, None, None, keep, 1000, 1000, 0.0,
                                             is_causal=True)
    want = sparse_attn.block_sparse_attn_func(q, k, v, cu, cu, None, None, keep, 1000, 1000, 0.0,
                                              is_causal=True, backend="reference")
    err = (got.float() - want.float()).abs().max().item()
    assert err < 3e-2, f"native differs from the reference by {err}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="32K only")
    ap.add_argument("--csv")
    ap.add_argument("--only", default="", help="cases whose name contains this")
    ap.add_argument("--no-baselines", action="store_true", help="time ours alone")
    ap.add_argument("--skip-check", action="store_true",
                    help="no native-vs-reference check (variants wrong on purpose)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of ours and base")
    args = ap.parse_args()
    global ROUNDS
    ROUNDS = args.rounds
    if not args.skip_check:
        check_once()
    gemm = gemm_ceiling()
    baselines = not args.no_baselines
    rows = []

    def wanted(name):
        return args.only in name

    sizes = [32768] if args.quick else [8192, 32768, 131072]
    for hq, hkv, d in ((32, 8, 128), (24, 2, 256)):
        for n in sizes:
            if wanted(f"dense_{n // 1024}k_{hq}_{hkv}_{d}"):
                rows += dense_rows(n, hq, hkv, d, gemm, baselines)
                print(*rows[-2 if baselines else -1:], flush=True)
    for hq, hkv, d in ((32, 8, 128), (24, 2, 256)):
        for n in ([32768] if args.quick else [32768, 131072]):
            for density in (0.3, 0.1):
                if wanted(f"sparse{int(density * 100)}_{n // 1024}k_{hq}_{hkv}_{d}"):
                    rows += sparse_rows(n, hq, hkv, d, density, gemm, baselines)
                    print(*rows[-2 if baselines else -1:], flush=True)
    for nk in [32768] if args.quick else [32768, 131072]:
        if wanted(f"chunk128_{nk // 1024}k_32_8_128"):
            rows += chunk_rows(128, nk, 32, 8, 128, gemm, baselines)
            print(*rows[-2 if baselines else -1:], flush=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("case,impl,ms,tflops,gemm_tflops,ratio,ours_spread\n")
            for r in rows:
                f.write(",".join(str(x) for x in r) + "\n")
    print(f"\nGEMM ceiling {gemm:.0f} TFLOP/s (bf16 8192^3, this run)")
    if not baselines:
        print(f"{'case':<26} {'ours ms':>9} {'TFLOP/s':>8} {'spread':>7}")
        for r in rows:
            print(f"{r[0]:<26} {r[2]:9.3f} {r[3]:8.0f} {100 * r[6]:6.1f}%")
        return
    print(f"{'case':<26} {'ours ms':>9} {'TFLOP/s':>8} {'spread':>7} {'base':>6} {'base ms':>9} "
          f"{'TFLOP/s':>8} {'ratio':>6}")
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        print(f"{a[0]:<26} {a[2]:9.3f} {a[3]:8.0f} {100 * a[6]:6.1f}% {b[1]:>6} {b[2]:9.3f} "
              f"{b[3]:8.0f} {b[5]:6.2f}")


if __name__ == "__main__":
    main()
