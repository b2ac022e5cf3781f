#!/usr/bin/env python3
"""Host overhead of the Python API for decode-sized calls (issue 3, item 6; goal < 10 us).

Measures, per call, the host time of each public decode-path function (argument handling,
output allocation, stream lookup, DLPack import, C++ validation and dispatch, the kernel
launch) and of the pieces it is made of, so the total can be read against its parts:

  full            sparse_attn.<fn>(...) as a serving engine calls it (allocates the output)
  out=            the same with a preallocated out= (no allocation)
  binding         sparse_attn._C.<fn>(...) with every argument ready (no Python wrapper)
  torch.ops       torch.ops.sparse_attn.<fn> (the custom op the compiled path uses)
  torch.empty     allocating the output alone
  stream lookup   the current-stream query alone

Each figure is the median over --repeats runs of --calls back-to-back calls timed with
time.perf_counter_ns on the host, without synchronising inside a run (the launches are
asynchronous; --calls is kept below the launch-queue depth so the host never waits for the
GPU). The GPU is synchronised between runs. On CUDA, kernels must be native: the reference
backend copies through the host and measures that instead.

Run on the GPU machine from a build tree:
  PYTHONPATH=build/python:python python3 bench/python_overhead.py
  PYTHONPATH=build/python:python python3 bench/python_overhead.py --batch 64 --json out.json
On a CPU-only machine, --device cpu --backend reference checks that the script runs (the
figures then include the reference computation and are not host overhead).
"""

import argparse
import json
import statistics
import sys
import time

import torch

import sparse_attn
from sparse_attn import _C
from sparse_attn import _runtime


def median_us_per_call(fn, calls, repeats, sync):
    for _ in range(3):  # warm up (first-call allocations, caches)
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls / 1e3)
        sync()
    return statistics.median(samples)


def decode_inputs(args, device):
    """A decode step: one query row per request, canonical QSA geometry, paged caches."""
    B = args.batch
    torch.manual_seed(0)

    def rand(shape, dtype=torch.bfloat16):
        return torch.randn(shape, dtype=dtype, device=device)

    ctx_tokens = args.context
    page = args.page_size
    pages_per_req = (ctx_tokens + page - 1) // page
    kv_pages = B * pages_per_req
    table = torch.arange(kv_pages, dtype=torch.int32, device=device).view(B, pages_per_req)
    # Indexer: H4/D128 queries, compressed keys (one per 4 tokens) in pages of 64.
    idx_page = 64
    idx_pages_per_req = (ctx_tokens // 4 + idx_page - 1) // idx_page
    idx = dict(
        q=rand((B, 1, 4, 128)),
        k_cache=rand((B * idx_pages_per_req, idx_page, 1, 128)),
        page_table=torch.arange(B * idx_pages_per_req, dtype=torch.int32,
                                device=device).view(B, idx_pages_per_req),
        context_lens=torch.full((B,), ctx_tokens // 4, dtype=torch.int32, device=device),
        max_model_len=idx_pages_per_req * idx_page,
    )
    width = 4 * 512 + 3
    ids = torch.randint(0, ctx_tokens, (B, width), dtype=torch.int32, device=device)
    attn = dict(
        query=rand((B, 24, 256)),
        key=rand((kv_pages, page, 2, 256)),
        value=rand((kv_pages, page, 2, 256)),
        token_indices=ids,
        cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=device),
        seq_lens_k=torch.full((B,), ctx_tokens, dtype=torch.int32, device=device),
        block_table=table,
    )
    return idx, attn


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="native")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=8192, help="tokens per request")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    be = args.backend
    idx, attn = decode_inputs(args, device)
    stream = _runtime.torch_stream(attn["query"])

    scores_out = torch.empty((args.batch, idx["max_model_len"]), dtype=torch.float32,
                             device=device)
    attn_out = torch.empty_like(attn["query"])
    rows = []

    def measure(name, fn):
        try:
            fn()
        except sparse_attn.NotSupportedError as e:
            rows.append((name, None, str(e)))
            return
        rows.append((name, median_us_per_call(fn, args.calls, args.repeats, sync), ""))

    i = idx
    measure("qsa_mqa_decode: full", lambda: sparse_attn.qsa_mqa_decode(
        i["q"], i["k_cache"], i["page_table"], i["context_lens"], i["max_model_len"],
        backend=be))
    measure("qsa_mqa_decode: out=", lambda: sparse_attn.qsa_mqa_decode(
        i["q"], i["k_cache"], i["page_table"], i["context_lens"], i["max_model_len"],
        backend=be, out=scores_out))
    measure("qsa_mqa_decode: binding", lambda: _C.qsa_mqa_decode(
        i["q"], i["k_cache"], i["page_table"], i["context_lens"], i["max_model_len"],
        scores_out, None, None, None, be, stream))
    measure("qsa_mqa_decode: torch.ops", lambda: torch.ops.sparse_attn.qsa_mqa_decode(
        i["q"], i["k_cache"], i["page_table"], i["context_lens"], i["max_model_len"],
        scores_out, None, None, None, be))

    a = attn
    measure("qsa_sparse_attention: full", lambda: sparse_attn.qsa_sparse_attention(
        a["query"], a["key"], a["value"], a["token_indices"], cu_seqlens_q=a["cu_seqlens_q"],
        seq_lens_k=a["seq_lens_k"], block_table=a["block_table"], backend=be))
    measure("qsa_sparse_attention: out=", lambda: sparse_attn.qsa_sparse_attention(
        a["query"], a["key"], a["value"], a["token_indices"], cu_seqlens_q=a["cu_seqlens_q"],
        seq_lens_k=a["seq_lens_k"], block_table=a["block_table"], backend=be, out=attn_out))
    # As an engine's decode step calls it (issue 15: <= 10 us): out= and a caller workspace of
    # the size the call asks (none on the gather kernel: a 16-byte buffer then).
    ws_bytes = sparse_attn.qsa_sparse_attention_workspace_size(
        a["query"], a["key"], a["value"], a["token_indices"], cu_seqlens_q=a["cu_seqlens_q"],
        seq_lens_k=a["seq_lens_k"], block_table=a["block_table"], backend=be)
    workspace = torch.empty(max(ws_bytes, 16), dtype=torch.uint8, device=device)
    measure(f"qsa_sparse_attention: out=, workspace {ws_bytes} B",
            lambda: sparse_attn.qsa_sparse_attention(
                a["query"], a["key"], a["value"], a["token_indices"],
                cu_seqlens_q=a["cu_seqlens_q"], seq_lens_k=a["seq_lens_k"],
                block_table=a["block_table"], backend=be, out=attn_out, workspace=workspace))
    measure("qsa_sparse_attention: binding", lambda: _C.qsa_sparse_attention(
        a["query"], a["key"], a["value"], a["token_indices"], attn_out, None, None,
        a["cu_seqlens_q"], None, None, None, None, a["seq_lens_k"], None, a["block_table"],
        None, None, None, None, be, False, False, None, None, 1.0, 1.0, torch.bfloat16, None,
        None, stream))
    measure("qsa_sparse_attention: torch.ops",
            lambda: torch.ops.sparse_attn.qsa_sparse_attention(
                a["query"], a["key"], a["value"], a["token_indices"], attn_out, None, None,
                a["cu_seqlens_q"], None, None, None, None, a["seq_lens_k"], None,
                a["block_table"], None, None, None, None, be, False, False, None, None, 1.0,
                1.0, torch.bfloat16, None, None))

    measure("torch.empty (the attention output)",
            lambda: torch.empty(a["query"].shape, dtype=a["query"].dtype, device=device))
    measure("stream lookup", lambda: _runtime.torch_stream(a["query"]))

    print(f"sparse_attn {sparse_attn.__version__} (CUDA backend built: "
          f"{sparse_attn.built_with_cuda}), torch {torch.__version__}, python "
          f"{sys.version.split()[0]}")
    print(f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if cuda else "") +
          f", backend {be}, batch {args.batch}, context {args.context} tokens, "
          f"{args.calls} calls x {args.repeats} runs, median host us/call")
    for name, us, note in rows:
        print(f"  {name:40s} " + (f"{us:8.2f} us" if us is not None else f"  not run: {note}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [
                {"name": n, "us_per_call": us, "note": note} for n, us, note in rows]}, f,
                indent=2)


if __name__ == "__main__":
    main()
