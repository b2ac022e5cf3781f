"""QSA prefill sparse attention against dense causal attention (issue 13's benchmark).

One request of N tokens, 24/2/256 BF16, paged K/V (page 64 or 1600, pages scattered), every
row p selecting 512 four-token blocks plus its tail (issue 13's two selections, seeded):
  random: vis = (p + 1) // 4 visible blocks; vis <= 512 takes blocks 0 .. vis - 1, else 512
          drawn uniformly with replacement from [0, vis);
  window: the 64 most recent blocks vis - 1 .. vis - 64 plus 448 drawn once per aligned
          64-row window w, with replacement, from [0, (64 w + 1) // 4), shared by its rows.
Each selection is expanded to tokens (4b .. 4b + 3, then the tail 4 ((p + 1) // 4) .. p), and
the block hint is passed too; element-wise sigmoid gate, LSE returned. --kv fp8 keeps the cache
in FP8 e4m3 (k_scale = v_scale = 1/16; cases named _fp8).

Baseline in the same run: cuDNN SDPA dense causal attention of the same shape (K/V expanded
to 24 heads), once per N. Printed: time, useful TFLOP/s (4 x 24 x 256 x valid tokens of each
row), dense time / ours, and the mean union of blocks over tiles of 10 consecutive rows (the
union kernel's CTA), against 513 for fully shared rows.

Timing: cuda_timing.time_ms (L2 flushed before every run, median).
With --kernels, each case also prints the GPU time of every kernel one call launches
(torch.profiler), so the time outside the attention kernels shows.

Usage: python3 bench/qsa_prefill_bench.py [--quick] [--n 16384,65536] [--pages 64,1600]
    [--kinds random,window] [--kv bf16,fp8] [--kernels]
"""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparse_attn
from cuda_timing import time_ms

HQ, HKV, D, NB, RECENT = 24, 2, 256, 512, 64


def selection(n, kind, gen):
    p = torch.arange(n, device="cuda")
    vis = (p + 1) // 4
    cols = torch.arange(NB, device="cuda")
    full = torch.where(cols[None, :] < vis[:, None], cols[None, :], -1)
    if kind == "random":
        drawn = (torch.rand(n, NB, device="cuda", generator=gen) * vis[:, None]).long()
    else:
        recent = vis[:, None] - 1 - cols[None, :RECENT]
        windows = (n + 63) // 64
        first_vis = torch.clamp((64 * torch.arange(windows, device="cuda") + 1) // 4, min=1)
        shared = (torch.rand(windows, NB - RECENT, device="cuda", generator=gen) *
                  first_vis[:, None]).long()
        drawn = torch.cat([recent, shared[p // 64]], dim=1)
    blocks = torch.where(vis[:, None] <= NB, full, drawn).to(torch.int32)
    tokens = 4 * blocks[:, :, None].long() + torch.arange(4, device="cuda")
    tokens = torch.where(blocks[:, :, None] >= 0, tokens, -1).reshape(n, 4 * NB)
    tail = 4 * vis[:, None] + torch.arange(3, device="cuda")
    tail = torch.where(tail <= p[:, None], tail, -1)
    ids = torch.cat([tokens, tail], dim=1).to(torch.int32)
    return blocks.contiguous(), ids.contiguous()


def union_per_tile(blocks, rows=10):
    n = blocks.shape[0] // rows * rows
    t = blocks[:n].reshape(-1, rows * NB).sort(dim=1).values
    distinct = 1 + (t[:, 1:] != t[:, :-1]).sum(dim=1) - (t[:, 0] < 0).long()
    return distinct.float().mean().item()


def dense_ms(n, gen):
    q = torch.rand(1, HQ, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) - 0.5
    k = torch.rand(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) - 0.5
    v = torch.rand(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) - 0.5
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return time_ms(fn, warmup=1, reps=3)


def ours(n, page, kind, gen, kv="bf16"):
    pages = (n + page - 1) // page
    cache = torch.rand(pages, page, HKV, 2 * D, device="cuda", dtype=torch.bfloat16,
                       generator=gen) - 0.5
    scales = {}
    if kv == "fp8":
        cache = (cache * 16).to(torch.float8_e4m3fn)
        scales = dict(k_scale=1 / 16, v_scale=1 / 16)
    k, v = cache[..., :D], cache[..., D:]  # strided views of one cache, as engines keep it
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)[None, :]
    q = torch.rand(n, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen) - 0.5
    gate = torch.rand(n, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen) - 0.5
    blocks, ids = selection(n, kind, gen)
    positions = torch.arange(n, device="cuda", dtype=torch.int32)
    seq_k = torch.tensor([n], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    lse = torch.empty(n, HQ, device="cuda", dtype=torch.float32)

    def fn():
        sparse_attn.qsa_sparse_attention(
            q, k, v, ids, block_indices=blocks, query_positions=positions,
            seq_lens_k=seq_k, block_table=table, page_size=page, gate=gate, out=out, lse=lse,
            backend="native", **scales)

    ms = time_ms(fn, warmup=1, reps=3 if n > 65536 else 5)
    valid = (ids >= 0).sum().item()
    return ms, 4.0 * HQ * D * valid / ms / 1e9, union_per_tile(blocks), fn


def print_kernels(fn):
    """The kernels of one call of fn and their GPU times."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" or e.device_time_total <= 0:
            continue
        total += e.device_time_total
        print(f"    {e.device_time_total / 1e3:9.3f} ms  x{e.count:<3} {e.key[:100]}")
    print(f"    {total / 1e3:9.3f} ms  in all")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16K and 64K, page 64 only")
    ap.add_argument("--n", default="16384,65536,131072")
    ap.add_argument("--pages", default="64,1600")
    ap.add_argument("--kinds", default="random,window")
    ap.add_argument("--kv", default="bf16", help="cache dtypes: bf16, fp8 or both")
    ap.add_argument("--kernels", action="store_true", help="each kernel's time of one call")
    a = ap.parse_args()
    ns = [16384, 65536] if a.quick else [int(x) for x in a.n.split(",")]
    pages = [64] if a.quick else [int(x) for x in a.pages.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(13)
    print(f"{'case':32} {'ours ms':>9} {'TFLOP/s':>8} {'dense ms':>9} {'x dense':>8} "
          f"{'union/tile':>10}")
    for n in ns:
        dense = dense_ms(n, gen)
        for page in pages:
            for kind in a.kinds.split(","):
                for kv in a.kv.split(","):
                    ms, tflops, union, fn = ours(n, page, kind, gen, kv)
                    name = f"{kind}_{n // 1024}k_page{page}" + ("_fp8" if kv == "fp8" else "")
                    print(f"{name:32} {ms:9.3f} {tflops:8.1f} {dense:9.3f} {dense / ms:8.2f} "
                          f"{union:10.0f}", flush=True)
                    if a.kernels:
                        print_kernels(fn)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
