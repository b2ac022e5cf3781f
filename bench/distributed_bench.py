"""Context-parallel prefill across GPUs (issue 19): sparse_attn.distributed's
qsa_prefill_context_parallel and xattn_prefill_context_parallel on 1, 2, 4, 8 GPUs of one host,
each world measured in the same run, so the scaling efficiency is against the one-GPU time of
this run.

Shapes: one request of --tokens tokens (default 128K and 1M), bf16. QSA: 24/2/256 heads, the
indexer's 4 x 128 queries and compressed keys, top-512 blocks expanded to tokens, a per-head
gate. XAttention: 32/8/128 heads, stride 8, threshold 0.9, block 128. Inputs are Gaussian,
drawn on each device from one seed (every world sees the same tensors); on them XAttention's
estimate keeps most blocks at 0.9, so its rows measure a near-dense prefill. The ranks hold
zigzag_ranges (2N chunks, rank r chunks r and 2N - 1 - r).

decode: one QSA decode step of 8 requests at position tokens - 1 with K/V and the compressed
indexer cache sharded by sequence (contiguous shards): the shard's indexer scores, the global
top-512 (qsa_topk_blocks_sharded), the expansion, the sharded attention (partials gathered and
merged through their LSE). Decode scales for memory, not speed: its step is tens of
microseconds, of the order of the collectives' latency.

Per (method, tokens, world): the step time (CUDA events around the call on every rank, after
a barrier; the slowest rank's, median of --reps), the fastest rank's (the imbalance), the
scaling efficiency t(1) / (N t(N)), the K/V gather alone (the same collective the call makes)
with the bytes each rank receives and their rate, the NCCL all_gather rate on a 1 GiB-a-rank
buffer measured in the same world (the link's ceiling for this collective), and the largest
difference of the outputs from the one-GPU run's on 64 rows spread over the sequence.

Usage, on a machine with several GPUs from the repository root (the Python extension built
as for bench/xattn_bench.py; NVLink multicast stays off: the NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 the machine sets are kept, and
set here when absent):
  PYTHONPATH=build-gpu/python:python python3 bench/distributed_bench.py --gpus 1,2,4,8 --csv F
--tokens 131072,1m (a k / m suffix means 1024 / 1048576), --methods qsa,xattn,decode, --reps N.
--smoke runs worlds 1 and 2 on the CPU (gloo, 2K tokens, 4/2/32 and 4/2/64 heads, the CPU
backend) to check the script where there is no GPU. Prints a markdown table.
"""
import argparse
import csv
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

SAMPLES = 64  # output rows compared against the one-GPU run
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def length(text):
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def shapes(smoke):
    if smoke:
        return dict(qsa=(4, 2, 32), xattn=(4, 2, 64), decode=(4, 2, 32))
    return dict(qsa=(24, 2, 256), xattn=(32, 8, 128), decode=(24, 2, 256))


class Clock:
    """Step timing on every rank: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, cuda):
        self.cuda = cuda

    def __call__(self, fn, group):
        dist.barrier(group)
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)


def rank_times(clock, fn, reps, group):
    """(slowest rank's median ms, fastest rank's median ms) over reps runs after one warm-up."""
    fn()
    mine = statistics.median(clock(fn, group) for _ in range(reps))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return max(every), min(every)


def allgather_rate(clock, device, world, group):
    """NCCL (or gloo) all_gather of 1 GiB a rank (16 MiB on the CPU): GB/s received a rank."""
    per_rank = (1 << 30) if device.type == "cuda" else (16 << 20)
    src = torch.empty(per_rank, dtype=torch.uint8, device=device)
    dst = torch.empty(world * per_rank, dtype=torch.uint8, device=device)
    ms, _ = rank_times(clock, lambda: dist.all_gather_into_tensor(dst, src, group=group), 3,
                       group)
    return (world - 1) * per_rank / (ms * 1e-3) / 1e9


def sample_positions(total):
    return sorted({(2 * i + 1) * total // (2 * SAMPLES) for i in range(SAMPLES)})


def rows_of(t, own, dim):
    return torch.cat([t.narrow(dim, s, n) for s, n in own], dim=dim)


def bf16_randn(device, seed):
    """randn(*shape) in bf16 on `device` from one seed: the same values in every world."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return lambda *shape: torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)


def qsa_case(sd, total, world, rank, device, heads, backend):
    hq, hkv, d = heads
    randn = bf16_randn(device, 1234)
    own = sd.zigzag_ranges(total, world, align=4)
    mine = own[rank]
    tensors = dict(query=randn(total, hq, d), key=randn(total, hkv, d),
                   value=randn(total, hkv, d), q_idx=randn(total, 4, 128),
                   block_keys=randn(total // 4, 128), gate=randn(total, hq))
    local = {name: rows_of(t, [(s // 4, n // 4) for s, n in mine] if name == "block_keys"
                           else mine, 0) for name, t in tensors.items()}
    del tensors
    blocks = [[(s // 4, n // 4) for s, n in r] for r in own]

    # Scores in chunks of up to 4 GiB (4096 rows of 1M-token rows) rather than the default 1.
    indexer = {"backend": backend, "max_workspace_bytes": 4 << 30}

    def step():
        return sd.qsa_prefill_context_parallel(
            local["query"], local["key"], local["value"], local["q_idx"], local["block_keys"],
            ranges=own, gate=local["gate"], backend=backend, indexer_options=indexer)

    def gather():
        # The collective the call makes (sparse_attn.distributed's own packing), timed alone.
        return sd._gather_sequences(
            [("key", local["key"], own, 0), ("value", local["value"], own, 0),
             ("block_keys", local["block_keys"], blocks, 0)], rank, world, None)

    token_bytes = (2 * hkv * d + 128 // 4) * 2
    return step, gather, mine, token_bytes, 0


def xattn_case(sd, total, world, rank, device, heads, backend):
    hq, hkv, d = heads
    randn = bf16_randn(device, 4321)
    own = sd.zigzag_ranges(total, world, align=128)
    mine = own[rank]
    q, k, v = randn(1, hq, total, d), randn(1, hkv, total, d), randn(1, hkv, total, d)
    q, k, v = (rows_of(t, mine, 2) for t in (q, k, v))

    def step():
        return sd.xattn_prefill_context_parallel(q, k, v, 8, ranges=own, threshold=0.9,
                                                 backend=backend)

    def gather():
        return sd._gather_sequences([("key_states", k, own, 2), ("value_states", v, own, 2)],
                                    rank, world, None)

    return step, gather, mine, 2 * hkv * d * 2, 2


DECODE_BATCH = 8
DECODE_PAGE = 64  # the compressed indexer cache's page, in blocks


def decode_case(sd, total, world, rank, device, heads, backend):
    """One QSA decode step of DECODE_BATCH requests at position total - 1, K/V and the indexer
    cache sharded by sequence (contiguous shards: decode rows see every token): the indexer
    scores of the shard's blocks, the global top-512 (qsa_topk_blocks_sharded), the expansion,
    the sharded attention (partials gathered and merged)."""
    import sparse_attn

    hq, hkv, d = heads
    batch = 2 if device.type == "cpu" else DECODE_BATCH
    randn = bf16_randn(device, 99)
    # Every rank draws the whole tensors (the same values in every world) and keeps its shard.
    cut = [total * r // world // 4 * 4 for r in range(world)] + [total]
    start, n = cut[rank], cut[rank + 1] - cut[rank]
    query, q_idx, gate = randn(batch, 1, hq, d), randn(batch, 4, 128), randn(batch, 1, hq)
    keys, values = randn(batch, total, hkv, d), randn(batch, total, hkv, d)
    key_shard = keys[:, start:start + n].contiguous()
    value_shard = values[:, start:start + n].contiguous()
    block_keys = randn(batch, total // 4, 128)
    local_blocks = n // 4
    local_pages = max(1, -(-local_blocks // DECODE_PAGE))
    cache = torch.zeros(batch, local_pages * DECODE_PAGE, 128, dtype=torch.bfloat16,
                        device=device)
    cache[:, :local_blocks] = block_keys[:, start // 4:start // 4 + local_blocks]
    cache = cache.view(batch * local_pages, DECODE_PAGE, 128)
    del keys, values, block_keys
    table = torch.arange(batch * local_pages, dtype=torch.int32, device=device)
    table = table.view(batch, local_pages)
    lens = torch.full((batch,), local_blocks, dtype=torch.int32, device=device)
    positions = torch.full((batch,), total - 1, dtype=torch.int32, device=device)

    def step():
        scores = sparse_attn.qsa_mqa_decode(q_idx, cache, table, lens,
                                            local_pages * DECODE_PAGE, backend=backend)
        ids = sd.qsa_topk_blocks_sharded(scores[:, :local_blocks].contiguous(), 512,
                                         block_offset=start // 4)
        tokens = sparse_attn.qsa_expand_blocks(ids, positions)
        return sd.qsa_sparse_attention_sharded(
            query, key_shard, value_shard, tokens[:, None], shard_start=start, shard_len=n,
            query_positions=positions[:, None], gate=gate, backend=backend)

    mine = [(0, batch)]  # every rank returns every request's row
    return step, None, mine, 0, 0


CASES = {"qsa": qsa_case, "xattn": xattn_case, "decode": decode_case}


def worker(rank, world, port, args, workdir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    from sparse_attn import distributed as sd

    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10),
                            **({"device_id": device} if cuda else {}))
    clock = Clock(cuda)
    backend = "native"
    rows = []
    try:
        link = allgather_rate(clock, device, world, None) if world > 1 else None
        for method in args.methods:
            for total in args.tokens:
                step, gather, mine, token_bytes, dim = CASES[method](
                    sd, total, world, rank, device, shapes(args.smoke)[method], backend)
                reps = args.reps * (10 if method == "decode" else 1)
                slow, fast = rank_times(clock, step, reps, None)
                gathers = world > 1 and gather is not None
                gather_ms = rank_times(clock, gather, args.reps, None)[0] if gathers else 0.0
                received = sum(n for s, n in mine)  # this rank's rows; the rest it receives
                received = (total - received) * token_bytes
                # Output rows at the sample positions this rank holds, for the comparison
                # (decode: every request's row, which every rank returns).
                out = step()
                positions, at = [], 0
                for s, n in mine:
                    wanted = range(s, s + n) if method == "decode" else sample_positions(total)
                    positions += [(p, at + p - s) for p in wanted if s <= p < s + n]
                    at += n
                sample = {p: out.select(dim, i).float().cpu() for p, i in positions}
                torch.save(sample, os.path.join(workdir, f"{method}_{total}_{world}_{rank}.pt"))
                rows.append(dict(method=method, tokens=total, world=world, step_ms=slow,
                                 fastest_rank_ms=fast, gather_ms=gather_ms,
                                 received_bytes=received, link_gbps=link))
                del step, gather, out
                if cuda:
                    torch.cuda.empty_cache()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(rows, os.path.join(workdir, f"rows_{world}.pt"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(workdir, method, total, world):
    """Largest |difference| of this world's sample rows from the one-GPU run's (None without
    a one-GPU run)."""
    def load(w):
        rows = {}
        for r in range(w):
            path = os.path.join(workdir, f"{method}_{total}_{w}_{r}.pt")
            rows.update(torch.load(path))
        return rows

    if not os.path.exists(os.path.join(workdir, f"{method}_{total}_1_0.pt")):
        return None
    base, got = load(1), load(world)
    return max(float((got[p] - base[p]).abs().max()) for p in base)


def table(rows):
    lines = ["| method | tokens | GPUs | step ms | fastest rank ms | efficiency | gather ms | "
             "received GB | gather GB/s | all_gather GB/s | max diff vs 1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def f(key, spec):
            return "-" if r.get(key) is None else format(r[key], spec)
        rate = r["received_bytes"] / (r["gather_ms"] * 1e-3) / 1e9 if r["gather_ms"] else None
        lines.append(f"| {r['method']} | {r['tokens']} | {r['world']} | {f('step_ms', '.2f')} | "
                     f"{f('fastest_rank_ms', '.2f')} | {f('efficiency', '.1%')} | "
                     f"{f('gather_ms', '.2f')} | {r['received_bytes'] / 1e9:.3f} | "
                     f"{'-' if rate is None else format(rate, '.1f')} | {f('link_gbps', '.1f')} | "
                     f"{f('max_diff', '.3g')} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="1,2,4,8")
    parser.add_argument("--tokens", default="128k,1m")
    parser.add_argument("--methods", default="qsa,xattn,decode")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--csv")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    if any(m not in CASES for m in args.methods):
        parser.error(f"--methods: expected some of {sorted(CASES)}")
    if args.smoke:
        worlds, args.tokens = [1, 2], [2048]
    else:
        worlds = [int(w) for w in args.gpus.split(",")]
        args.tokens = [length(t) for t in args.tokens.split(",")]
        available = torch.cuda.device_count()
        if not available:
            parser.error("no GPU: run with --smoke to check the script on the CPU")
        skipped = [w for w in worlds if w > available]
        if skipped:
            print(f"skipping worlds {skipped}: {available} GPUs here", file=sys.stderr)
        worlds = [w for w in worlds if w <= available]
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for world in worlds:
            torch.multiprocessing.start_processes(worker, args=(world, free_port(), args, workdir),
                                                  nprocs=world, join=True,
                                                  start_method="spawn")
            rows += torch.load(os.path.join(workdir, f"rows_{world}.pt"))
        single = {(r["method"], r["tokens"]): r["step_ms"] for r in rows if r["world"] == 1}
        for r in rows:
            t1 = single.get((r["method"], r["tokens"]))
            r["efficiency"] = None if t1 is None else t1 / (r["world"] * r["step_ms"])
            r["max_diff"] = None if r["world"] == 1 else compare(workdir, r["method"],
                                                                 r["tokens"], r["world"])
    print(table(rows))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
