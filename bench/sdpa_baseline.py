"""Baselines for qsa_sparse_attention_bench, run in the same device call (issue 7, item 5).

prefill: PyTorch SDPA dense causal attention, [1, 24, N, 256] BF16 (K/V expanded from 2 KV
    heads, so the FLOPs are the canonical geometry's), N = 16K, 64K, 128K, through cuDNN
    (SDPBackend.CUDNN_ATTENTION; FlashAttention if cuDNN refuses the shape, and the row says
    which ran). FLOPs: 4 * Hq * D * N * (N + 1) / 2.
decode: what a framework does without a sparse kernel: gather the 2051 selected K/V rows of
    each request with index_select from the paged cache, then SDPA over them; B = 1, 8, 32,
    128, one query row each.

Timing: CUDA events, warm-up, L2 flushed before every timed run, median. Usage:
    python3 bench/sdpa_baseline.py [results.csv]
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import time_ms

HQ, HKV, D, PAGE, WIDTH = 24, 2, 256, 64, 2051


def prefill(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.rand(1, HQ, n, D, device="cuda", dtype=torch.bfloat16, generator=g) - 0.5
    k = (torch.rand(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g) - 0.5)
    v = (torch.rand(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g) - 0.5)
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    flops = 4.0 * HQ * D * n * (n + 1) / 2
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                ms = time_ms(fn, warmup=1, reps=3 if n > 65536 else 5)
            return (f"dense_causal_{n // 1024}k_{name}", ms, flops / ms / 1e9, "")
        except RuntimeError as e:  # the backend refused the shape: try the next one
            err = str(e).splitlines()[0]
    return (f"dense_causal_{n // 1024}k", float("nan"), float("nan"), err)


def decode_gather(batch):
    g = torch.Generator(device="cuda").manual_seed(batch)
    lens = torch.randint(8192, 131073, (batch,), generator=g, device="cuda")
    pages = int(((lens + PAGE - 1) // PAGE).sum())
    cache_k = torch.rand(pages * PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cache_v = torch.rand(pages * PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.rand(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    # Physical rows of each request's selection (pages already translated: the gather alone).
    rows = torch.randint(0, pages * PAGE, (batch, WIDTH), generator=g, device="cuda")

    def fn():
        k = cache_k.index_select(0, rows.flatten()).view(batch, WIDTH, HKV, D).transpose(1, 2)
        v = cache_v.index_select(0, rows.flatten()).view(batch, WIDTH, HKV, D).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    ms = time_ms(fn)
    return (f"decode_b{batch}_gather_sdpa", ms, 4.0 * batch * WIDTH * HQ * D / ms / 1e9, "")


def main():
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    results = [decode_gather(b) for b in (1, 8, 32, 128)]
    results += [prefill(n) for n in (16384, 65536, 131072)]
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write("name,ms,tflops,note\n")
            for r in results:
                f.write(f"{r[0]},{r[1]:.5f},{r[2]:.2f},\"{r[3]}\"\n")
    print(f"\n{'baseline':<28} {'ms':>10} {'TFLOP/s':>8}  note")
    for name, ms, tf, note in results:
        print(f"{name:<28} {ms:>10.4f} {tf:>8.1f}  {note}")


if __name__ == "__main__":
    main()
