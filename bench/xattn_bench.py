"""XAttention on the H200 (issue 14's benchmarks): the native estimate and the whole prefill,
each against cuDNN dense causal attention of the same shape, measured in the same process.

Shapes: batch 1, 32 query / 8 KV heads, head dim 128, bf16, query = key = the whole prompt,
causal, block 128, stride 8, threshold 0.9, on the structured workload below.

estimate_<L>: xattn_estimate alone (strided sums, softmax, block sums and the threshold
    selection) at 32K / 64K / 128K tokens. Printed: its time, the fraction of the dense time it
    takes, and its TFLOP/s with FLOPs = 2 * (L/stride)^2 / 2 * (stride * D) * Hq (the causal
    half of the strided Q K^T product; the softmax and the selection are not counted).
prefill_<L>: xattention_prefill end to end at 32K and 128K, then the estimate alone and the
    block-sparse attention alone (block_sparse_attn_func over the estimate's mask), so that
    estimate + attention can be read against the total. Printed: the times, dense / total, the
    density (kept blocks / causal blocks, from the prefill's block_mask) and the attention-mass
    recall: for 64 query rows spread evenly over the prompt (heads cycling) plus the middle row
    of each needle span, the share of the row's dense softmax mass (FP32, torch, on the
    device, one row x L at a time per KV head) that falls in its kept blocks.

Baseline: torch SDPA under sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), q [1, 32, L, 128], k/v
[1, 8, L, 128] through enable_gqa=True (torch 2.11's cuDNN backend takes it: checked on the
H200, bitwise equal to repeated K/V and a little faster); a torch whose cuDNN refuses GQA gets
K/V repeated to 32 heads (block_sparse_bench.cudnn_fn), and the row's name says which ran
(cudnn_gqa / cudnn_rep). Dense FLOPs: 4 * Hq * D * L (L + 1) / 2.

Timing: block_sparse_bench.rows_for (cuda_timing.time_ms: CUDA events, warm-up, L2 flushed
before every run, median), ours and the baseline alternating --rounds times; the ratio is the
median of the rounds' ratios, the spread that of our rounds. The ops write into preallocated
outputs (xattn_estimate's out=, block_sparse_attn_func's out=, the torch op
sparse_attn::xattention_prefill with its attn_sums / block_mask / out), so allocation is not
timed. Before timing, one small native-vs-reference check of the estimate (--skip-check leaves
it out).

The structured workload is synthetic and built here with torch: Python does not expose the
library's generator (include/sparse_attn/workload.h, C++ only). It follows that generator's
model and default strengths with torch's random numbers (so not the same tensors), drawn on
the host from a fixed seed per length, so every machine gets the same tensors. Every vector
is a sum of named parts whose strength is the softmax logit (scale * q.k, nats) it adds:
  - content: unit vectors of rank 16, one topic per segment of 256..768 tokens plus a small
    per-token variation; query heads see it through I + 0.3 N(0, 1/16) mixes;
  - locality: the content projected onto D/4 rotary dims and rotated by RoPE (theta 1e4), 10
    nats at distance 0, decaying as the frequencies dephase; topic: the content unrotated in
    the other dims, 2 nats for any key of the query's segment;
  - sinks: keys 0..3 share a direction with every query (10.5 nats);
  - heavy hitters: 2% of the other keys share another direction with every query (4 nats);
  - needles: 8 keys in the first half each share a private direction (15 nats) with a span of
    16 query rows at least L/4 later (retrieval);
  - noise 0.1 x the structured RMS; values N(0, 1).
The selection is sparse but not trivial: the sink block and a local band are kept, far blocks
as the heavy hitters and the background need to reach 0.9, the needles' blocks often not (16
rows of a 128-row block). The native CPU backend selected, on these tensors (density; mean
recall over all sampled rows / the needle rows): 32K 19.6%, 78.6% / 43.3%; 64K 23.3%, 85.6% /
76.0%; 128K 33.0%, 85.5% / 64.6%. The C++ generator's `sparse-attn demo` at 32K gave
21.5% and 73.6% on its own sampled rows (docs/perf-notes.md). A GPU estimate should give
these densities up to near-ties; i.i.d. Gaussian q/k would make the selection nearly dense at
0.9.

Usage, on the GPU machine from the repository root (third_party carried, as for
scripts/gpu-check; only the Python extension is needed):
  cmake -S . -B build-gpu -G Ninja -DSPARSE_ATTN_CUDA=ON -DPython_EXECUTABLE=$(command -v python3)
  cmake --build build-gpu -j $(nproc) --target _C
  PYTHONPATH=build-gpu/python:python python3 bench/xattn_bench.py --only estimate --csv F
  PYTHONPATH=build-gpu/python:python python3 bench/xattn_bench.py --only prefill --csv F
Options: --only PREFIX keeps the cases whose name starts with it (estimate, prefill,
prefill_128k); --lengths 32768,131072 replaces both groups' lengths (multiples of 128, a k
suffix means 1024); --rounds N (default 3); --skip-baselines times ours alone; --skip-check;
--threshold, --stride; --backend reference (small lengths only). --smoke runs L = 1024 with
4/2/64 heads on the CPU with backend 'reference' and torch's CPU SDPA as the baseline (no GPU):
  PYTHONPATH=build/python:python python3 bench/xattn_bench.py --smoke
The summary is printed as markdown tables, ready for docs/perf-notes.md.
"""
import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import block_sparse_bench
import sparse_attn
from block_sparse_bench import BLOCK, causal_pairs, cudnn_fn, gemm_ceiling, rows_for

# Structure of the workload (include/sparse_attn/workload.h's defaults).
RANK, SEGMENT, TOKEN_VARIATION, HEAD_VARIATION = 16, 512, 0.15, 0.3
SINKS, SINK_LOGIT, HEAVY_FRACTION, HEAVY_LOGIT = 4, 10.5, 0.02, 4.0
LOCAL_LOGIT, TOPIC_LOGIT, ROPE_THETA = 10.0, 2.0, 10000.0
NEEDLES, NEEDLE_LOGIT, NEEDLE_QUERIES, NOISE = 8, 15.0, 16, 0.1

ESTIMATE_LENGTHS = [32768, 65536, 131072]
PREFILL_LENGTHS = [32768, 131072]
RECALL_ROWS = 64


def place_needles(n, gen):
    """(key, first query row, end) of each needle: the key after the sinks in the first half,
    its span of query rows at least n / 4 later (workload.cpp's place_needles)."""
    span, far = min(NEEDLE_QUERIES, n - SINKS - 1), n // 4
    needles = []
    for _ in range(NEEDLES):
        start = int(torch.randint(SINKS + 1 + far, n - span + 1, (1,), generator=gen))
        key_hi = min(max(min(start - far, n // 2), SINKS + 1), max(start, SINKS + 1))
        key = int(torch.randint(SINKS, key_hi, (1,), generator=gen))
        needles.append((key, start, start + span))
    return needles


def structured_workload(n, hq, hkv, d, seed, device, dtype=torch.bfloat16):
    """q [1, hq, n, d], k and v [1, hkv, n, d] on `device` (contiguous, upstream's layout) and
    the needles; the module docstring states the model. Generated on the host (torch's CPU
    generator), so every machine gets the same tensors for a seed."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    scale = 1.0 / math.sqrt(d)

    def amp(logit):  # scale * (a u).(a u) = logit for a unit vector u
        return math.sqrt(logit / scale)

    rot = (d // 4) & ~1
    un, half, topic_cols = d - rot, rot // 2, min(RANK, d - rot)
    nvec = topic_cols + 2 + NEEDLES  # topic columns, sink, heavy hitters, one per needle
    assert nvec <= un, f"head dim {d} leaves {un} unrotated dims for {nvec} directions"
    noise_std = NOISE * math.sqrt((amp(LOCAL_LOGIT) ** 2 + amp(TOPIC_LOGIT) ** 2) / d)

    # Latent content: one topic per segment (lengths uniform in [S/2, 3S/2]), unit vectors.
    lens = torch.randint(SEGMENT // 2, 3 * SEGMENT // 2 + 1, (2 * n // SEGMENT + 1,),
                         generator=gen)
    pos = torch.arange(n)
    segment = torch.bucketize(pos, lens.cumsum(0), right=True)
    topics = randn(lens.numel(), RANK)
    z = math.sqrt(1 - TOKEN_VARIATION ** 2) * topics[segment] + TOKEN_VARIATION * randn(n, RANK)
    z = z / z.norm(dim=1, keepdim=True)

    angle = pos[:, None].float() * ROPE_THETA ** (-torch.arange(half) / half)
    cos, sin = angle.cos(), angle.sin()
    heavy = (pos >= SINKS) & (torch.rand(n, generator=gen) < HEAVY_FRACTION)
    needles = place_needles(n, gen)
    key_needle = torch.zeros(n, NEEDLES)
    query_needle = torch.zeros(n, NEEDLES)
    for j, (key, begin, end) in enumerate(needles):
        key_needle[key, j] = 1
        query_needle[begin:end, j] = 1

    def build(zz, proj, basis, sink, hit, needle):
        """One head's vectors [n, d]: RoPE'd content, then topic, sink, heavy, needle parts."""
        c = amp(LOCAL_LOGIT) * zz @ proj.T
        c1, c2 = c[:, :half], c[:, half:]
        u = amp(TOPIC_LOGIT) * zz[:, :topic_cols] @ basis[:, :topic_cols].T
        u += amp(SINK_LOGIT) * sink[:, None] * basis[:, topic_cols]
        u += amp(HEAVY_LOGIT) * hit[:, None] * basis[:, topic_cols + 1]
        u += amp(NEEDLE_LOGIT) * needle @ basis[:, topic_cols + 2:].T
        x = torch.cat([c1 * cos - c2 * sin, c1 * sin + c2 * cos, u], dim=1)
        return (x + noise_std * randn(n, d)).to(dtype)

    q = torch.empty(1, hq, n, d, dtype=dtype)
    k = torch.empty(1, hkv, n, d, dtype=dtype)
    v = randn(1, hkv, n, d).to(dtype)
    ones = torch.ones(n)
    for g in range(hkv):
        proj = randn(rot, RANK) / math.sqrt(rot)
        basis = torch.linalg.qr(randn(un, nvec))[0]  # orthonormal columns
        k[0, g] = build(z, proj, basis, (pos < SINKS).float(), heavy.float(), key_needle)
        for h in range(g * hq // hkv, (g + 1) * hq // hkv):
            mix = torch.eye(RANK)
            mix += HEAD_VARIATION / math.sqrt(RANK) * randn(RANK, RANK)
            q[0, h] = build(z @ mix.T, proj, basis, ones, ones, query_needle)
    return q.to(device), k.to(device), v.to(device), needles


def recall_samples(n, hq, needles):
    """(row, head) pairs: RECALL_ROWS rows spread evenly, heads cycling, plus each needle
    span's middle row."""
    rows = [((2 * i + 1) * n) // (2 * RECALL_ROWS) for i in range(RECALL_ROWS)]
    rows += [(begin + end) // 2 for _, begin, end in needles]
    return [(r, i % hq) for i, r in enumerate(rows)]


def mass_recall(q, k, mask, samples):
    """Per sampled (row, head): the share of its causal softmax mass (FP32) in the kept blocks
    of mask [1, Hq, QB, KB]. Scores are computed one KV head at a time ([rows, L])."""
    hq, hkv, n = q.shape[1], k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[3])
    keys = torch.arange(n, device=q.device)
    recall = []
    for g in range(hkv):
        mine = [(r, h) for r, h in samples if h // (hq // hkv) == g]
        if not mine:
            continue
        rows = torch.tensor([r for r, _ in mine], device=q.device)
        heads = torch.tensor([h for _, h in mine], device=q.device)
        s = (q[0, heads, rows].float() @ k[0, g].float().T) * scale
        s = s.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
        p = torch.softmax(s, dim=1)
        kept = mask[0, heads, rows // BLOCK].repeat_interleave(BLOCK, dim=1)[:, :n]
        recall += (p * kept).sum(dim=1).tolist()
    return statistics.mean(recall), min(recall)


def density(mask):
    """Kept causal blocks / causal blocks of a square causal mask [1, H, QB, QB], and the
    count of kept blocks past the diagonal (0 for a correct selection)."""
    qb = mask.shape[-1]
    causal = torch.ones(qb, qb, dtype=torch.bool, device=mask.device).tril()
    kept = (mask[0] & causal).sum().item()
    return kept / (mask.shape[1] * qb * (qb + 1) // 2), (mask[0] & ~causal).sum().item()


def dense_fn(q, k, v, smoke):
    """Dense causal attention on [1, H, L, D] and its name: cuDNN with enable_gqa, cuDNN on
    repeated K/V if it refuses GQA, torch's CPU SDPA in the smoke run."""
    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if smoke:
        return sdpa, "sdpa_cpu"

    def cudnn_gqa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return sdpa()
    try:
        cudnn_gqa()
        return cudnn_gqa, "cudnn_gqa"
    except RuntimeError as e:  # cuDNN refused GQA: K/V repeated, as block_sparse_bench does
        print(f"  cuDNN refused enable_gqa ({str(e).splitlines()[0][:120]}); K/V repeated")
        views = [x[0].transpose(0, 1) for x in (q, k, v)]  # [L, H, D], what cudnn_fn takes
        return cudnn_fn(*views, q.shape[1], k.shape[1], True), "cudnn_rep"


class Case:
    """One length's tensors and preallocated outputs, and the three ops writing into them."""

    def __init__(self, n, hq, hkv, d, backend, threshold, stride, device):
        self.n, self.hq, self.hkv, self.d = n, hq, hkv, d
        self.backend, self.threshold, self.stride = backend, threshold, stride
        self.q, self.k, self.v, self.needles = structured_workload(n, hq, hkv, d, n + d, device)
        qb = n // BLOCK
        self.est_sums = torch.empty(1, hq, qb, qb, device=device, dtype=torch.float32)
        self.est_mask = torch.empty(1, hq, qb, qb, device=device, dtype=torch.bool)
        self.pre_sums = torch.empty_like(self.est_sums)
        self.pre_mask = torch.empty_like(self.est_mask)
        self.pre_out = torch.empty_like(self.q)
        self.attn_out = torch.empty_like(self.q)
        self.cu = torch.tensor([0, n], dtype=torch.int32, device=device)

    def estimate(self):
        sparse_attn.xattn_estimate(self.q, self.k, BLOCK, self.stride, threshold=self.threshold,
                                   causal=True, backend=self.backend,
                                   out=(self.est_sums, self.est_mask))

    def attention(self):
        """Block-sparse attention over the estimate's mask, on [L, H, D] views of the same
        memory xattention_prefill reads."""
        q3, k3, v3, o3 = (x[0].transpose(0, 1) for x in (self.q, self.k, self.v, self.attn_out))
        sparse_attn.block_sparse_attn_func(q3, k3, v3, self.cu, self.cu, [1] * self.hq, None,
                                           self.est_mask, self.n, self.n, 0.0, is_causal=True,
                                           backend=self.backend, out=o3)

    def prefill(self):
        # Xattention_prefill allocates its attn_sums / block_mask and does not return the mask;
        # the torch op is its destination-passing form (the arguments of _torch_ops.py).
        torch.ops.sparse_attn.xattention_prefill(
            query=self.q, key=self.k, value=self.v, attn_sums=self.pre_sums,
            block_mask=self.pre_mask, out=self.pre_out, lse=None, threshold=self.threshold,
            head_thresholds=None, causal=True, keep_sink=False, keep_recent=False,
            block_size=BLOCK, stride=self.stride, norm=1.0, chunk_size=16384,
            select_mode="inverse", softmax_scale=None, backend=self.backend)


def estimate_flops(n, stride, d, hq):
    return 2.0 * (n / stride) ** 2 / 2 * (stride * d) * hq


def dense_flops(n, d, hq):
    return 4.0 * hq * d * n * (n + 1) / 2


def with_tflops(row, flops):
    """A rows_for row with its TFLOP/s recomputed from `flops` (rows_for counts the baseline's
    with ours' FLOPs)."""
    return row[:3] + (flops / row[2] / 1e9,) + row[4:]


def impl(label, rows):
    """rows_for's rows with ours ("ours") named `label`."""
    return [r[:1] + (label,) + r[2:] if r[1] == "ours" else r for r in rows]


def estimate_case(n, args, shape, gemm, device):
    hq, hkv, d = shape
    c = Case(n, hq, hkv, d, args.backend, args.threshold, args.stride, device)
    name = f"estimate_{n // 1024}k"
    flops = estimate_flops(n, args.stride, d, hq)
    base, base_name = dense_fn(c.q, c.k, c.v, args.smoke) if args.baselines else (None, "")
    rows = rows_for(name, base_name, flops, gemm, n, c.estimate, base)
    if base is not None:
        rows[1] = with_tflops(rows[1], dense_flops(n, d, hq))
    dens, past = density(c.est_mask)
    extra = dict(density=dens, note=f"{past} blocks past the diagonal" if past else "")
    return [r + (extra,) for r in rows]


def prefill_case(n, args, shape, gemm, device):
    hq, hkv, d = shape
    c = Case(n, hq, hkv, d, args.backend, args.threshold, args.stride, device)
    name = f"prefill_{n // 1024}k"
    base, base_name = dense_fn(c.q, c.k, c.v, args.smoke) if args.baselines else (None, "")
    # The total's TFLOP/s are dense-equivalent (dense causal FLOPs / its time).
    rows = impl("total", rows_for(name, base_name, dense_flops(n, d, hq), gemm, n, c.prefill,
                                  base))
    rows += impl("estimate", rows_for(name, "", estimate_flops(n, args.stride, d, hq), gemm, n,
                                      c.estimate, None))
    c.estimate()  # the mask the attention-alone runs read
    pairs = causal_pairs(c.est_mask[0])
    rows += impl("attention", rows_for(name, "", 4.0 * d * pairs, gemm, n, c.attention, None))
    dens, past = density(c.pre_mask)
    mean, worst = mass_recall(c.q, c.k, c.pre_mask, recall_samples(n, hq, c.needles))
    notes = [f"{past} blocks past the diagonal"] if past else []
    if not torch.equal(c.pre_mask, c.est_mask):
        notes.append("prefill mask != estimate mask")
    extra = dict(density=dens, recall_mean=mean, recall_min=worst, note="; ".join(notes))
    return [r + (extra,) for r in rows]


def check_estimate(backend, device):
    """A small estimate against the reference, so a broken build cannot print fast numbers:
    sums within 2e-2, at most 1% of the blocks selected differently (near-ties may flip)."""
    q, k, _, _ = structured_workload(2048, 4, 2, 128, 7, device)
    qb = 2048 // BLOCK
    got = [torch.empty(1, 4, qb, qb, device=device, dtype=t) for t in (torch.float32, torch.bool)]
    want = [torch.empty_like(t) for t in got]
    sparse_attn.xattn_estimate(q, k, BLOCK, 8, threshold=0.9, backend=backend, out=got)
    sparse_attn.xattn_estimate(q, k, BLOCK, 8, threshold=0.9, backend="reference", out=want)
    err = (got[0] - want[0]).abs().max().item()
    flipped = (got[1] != want[1]).float().mean().item()
    assert err < 2e-2 and flipped <= 0.01, (
        f"estimate ({backend}) differs from the reference: sums by {err}, masks in "
        f"{100 * flipped:.2f}% of the blocks")


def cpu_time_ms(fn, warmup=1, reps=3):
    """time_ms's contract with a host clock, for the smoke run (no CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def length(text):
    return int(text[:-1]) * 1024 if text.lower().endswith("k") else int(text)


def fmt(x, spec):
    return "" if x is None else format(x, spec)


def print_tables(rows, gemm, args):
    if gemm is not None:
        print(f"\nGEMM ceiling {gemm:.0f} TFLOP/s (bf16 8192^3, this run)")
    est = [r for r in rows if r[0].startswith("estimate")]
    if est:
        print("\nestimate FLOPs = 2 * (L/stride)^2 / 2 * (stride * D) * Hq (the causal half of the "
              f"strided Q K^T product), stride {args.stride}; dense FLOPs = 4 * Hq * D * L (L + 1) "
              f"/ 2; threshold {args.threshold}\n")
        print("| case | estimate ms | TFLOP/s | spread | density | baseline | dense ms | "
              "TFLOP/s | estimate / dense | dense / estimate |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in est:
            if r[1] != "ours":
                continue
            b = next((x for x in est if x[0] == r[0] and x[1] != "ours"), None)
            base = [b[1], f"{b[2]:.3f}", f"{b[3]:.3g}", f"{1 / b[5]:.3f}", f"{b[5]:.2f}"] if b \
                else [""] * 5
            print(f"| {r[0]} | {r[2]:.3f} | {r[3]:.3g} | {100 * r[6]:.1f}% | "
                  f"{100 * r[7]['density']:.1f}% | " + " | ".join(base) + " |")
    pre = [r for r in rows if r[0].startswith("prefill")]
    if pre:
        print(f"\nprefill: total = xattention_prefill; estimate and attention timed alone "
              f"(attention TFLOP/s over the kept (query, key) pairs); recall over "
              f"{RECALL_ROWS} spread rows + {NEEDLES} needle rows; threshold {args.threshold}\n")
        print("| case | total ms | estimate ms | attention ms | est + attn | baseline | "
              "dense ms | dense / total | attn TFLOP/s | density | recall mean | recall min |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name in dict.fromkeys(r[0] for r in pre):
            by = {r[1]: r for r in pre if r[0] == name}
            t, e, a = by["total"], by["estimate"], by["attention"]
            b = next((r for k, r in by.items() if k not in ("total", "estimate", "attention")),
                     None)
            x = t[7]
            print(f"| {name} | {t[2]:.3f} | {e[2]:.3f} | {a[2]:.3f} | {e[2] + a[2]:.3f} | "
                  f"{b[1] if b else ''} | {fmt(b and b[2], '.3f')} | {fmt(b and b[5], '.2f')} | "
                  f"{a[3]:.3g} | {100 * x['density']:.1f}% | {100 * x['recall_mean']:.2f}% | "
                  f"{100 * x['recall_min']:.2f}% |")
    notes = [f"{r[0]}: {r[7]['note']}" for r in rows if r[1] in ("ours", "total") and r[7]["note"]]
    for n in notes:
        print("note:", n)


def write_csv(path, rows):
    keys = ("density", "recall_mean", "recall_min", "note")
    with open(path, "w") as f:
        f.write("case,impl,ms,tflops,gemm_tflops,ratio,ours_spread," + ",".join(keys) + "\n")
        for r in rows:
            cells = ["" if x is None else str(x) for x in r[:7]]
            cells += [f"\"{r[7].get(k, '')}\"" if k == "note" else str(r[7].get(k, ""))
                      for k in keys]
            f.write(",".join(cells) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="cases whose name starts with this")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of ours and base")
    ap.add_argument("--lengths", help="tokens, comma-separated, for both groups")
    ap.add_argument("--skip-baselines", action="store_true", help="time ours alone")
    ap.add_argument("--skip-check", action="store_true", help="no estimate-vs-reference check")
    ap.add_argument("--csv", help="write every row here")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--backend", default="native", help="native or reference")
    ap.add_argument("--smoke", action="store_true",
                    help="L = 1024, 4/2/64, backend 'reference' on the CPU (no GPU)")
    args = ap.parse_args()
    args.baselines = not args.skip_baselines
    block_sparse_bench.ROUNDS = args.rounds
    if args.smoke:
        device, shape, args.backend = "cpu", (4, 2, 64), "reference"
        estimate_lengths = prefill_lengths = [1024]
        # rows_for times through block_sparse_bench's time_ms (CUDA events): a host clock here.
        block_sparse_bench.time_ms = cpu_time_ms
        gemm = None
        print(f"smoke: CPU, backend 'reference', 4/2/64, torch {torch.__version__}")
    else:
        device, shape = "cuda", (32, 8, 128)
        estimate_lengths, prefill_lengths = ESTIMATE_LENGTHS, PREFILL_LENGTHS
        print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
              f"{torch.cuda.get_device_name()}, backend '{args.backend}'")
        gemm = gemm_ceiling()
    if args.lengths:
        estimate_lengths = prefill_lengths = [length(x) for x in args.lengths.split(",")]
    for n in set(estimate_lengths + prefill_lengths):
        if n % BLOCK or n % args.stride:
            sys.exit(f"--lengths: {n} is not a multiple of the block ({BLOCK}) and the stride")
    if not args.skip_check:
        check_estimate("native" if args.smoke else args.backend, device)

    rows = []
    plan = [(f"estimate_{n // 1024}k", estimate_case, n) for n in estimate_lengths]
    plan += [(f"prefill_{n // 1024}k", prefill_case, n) for n in prefill_lengths]
    for name, run, n in plan:
        if not name.startswith(args.only):
            continue
        new = run(n, args, shape, gemm, device)
        for r in new:
            x = r[7]
            print(f"{r[0]:<14} {r[1]:<10} {r[2]:10.3f} ms {r[3]:8.2f} TFLOP/s"
                  + (f"  base/ours {r[5]:.3f}" if r[5] is not None else "")
                  + (f"  density {100 * x['density']:.1f}%" if r[1] in ("ours", "total") else "")
                  + (f"  recall {100 * x['recall_mean']:.2f}% (min {100 * x['recall_min']:.2f}%)"
                     if r[1] == "total" else ""), flush=True)
        rows += new
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.csv:
        write_csv(args.csv, rows)
    print_tables(rows, gemm, args)


if __name__ == "__main__":
    try:
        main()
    except sparse_attn.NotSupportedError as e:
        sys.exit(f"xattn_bench: {e}\n(the native CUDA estimate has not landed in this build; "
                 "--smoke exercises the script on the CPU)")
