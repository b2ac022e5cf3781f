"""torch integration: the custom ops (torch.ops.sparse_attn.*) pass torch's own op checks,
torch.compile traces the public functions into them, and on a GPU the ops run on the
caller's stream and inside CUDA graphs."""

import math

import pytest
import torch

import sparse_attn
from qsa_testing import call_native_or_skip, needs_cuda, randn

OPS = ["qsa_indexer_mqa_score", "qsa_mqa_prefill", "qsa_mqa_decode", "qsa_sparse_attention",
       "qsa_topk_blocks", "qsa_expand_blocks", "merge_attention_states", "xattn_estimate",
       "find_blocks_chunked", "block_sparse_attention", "block_sparse_attention_paged",
       "xattention_prefill"]


def decode_inputs(device, backend):
    H, D, page_size = 4, 128, 16
    q = randn((3, 1, H, D), torch.bfloat16, device)
    cache = randn((4, page_size, 1, D), torch.bfloat16, device)
    table = torch.tensor([[0, 1], [2, -1], [3, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 16, 1], dtype=torch.int32, device=device)
    return (q, cache, table, lens, 2 * page_size)


def attention_inputs(device):
    query = randn((2, 1, 24, 256), torch.bfloat16, device)
    key = randn((2, 32, 2, 256), torch.bfloat16, device)
    value = randn((2, 32, 2, 256), torch.bfloat16, device)
    ids = torch.randint(-1, 32, (2, 1, 16), dtype=torch.int32, device=device)
    return query, key, value, ids


def test_ops_are_registered():
    for name in OPS:
        assert hasattr(torch.ops.sparse_attn, name), name


def test_opcheck_decode_and_attention():
    q, cache, table, lens, width = decode_inputs("cpu", "reference")
    out = torch.empty((3, width), dtype=torch.float32)
    torch.library.opcheck(torch.ops.sparse_attn.qsa_mqa_decode.default,
                          (q, cache, table, lens, width, out, None, None, None, "reference"))
    query, key, value, ids = attention_inputs("cpu")
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:-1], dtype=torch.float32)
    torch.library.opcheck(
        torch.ops.sparse_attn.qsa_sparse_attention.default,
        (query, key, value, ids, out, lse, None, None, None, None, None, None, None, None, None,
         None, None, None, None, "reference", False, False, None, None, 1.0, 1.0,
         torch.bfloat16, None, None))
    # FP8 caches as uint8 storage with the format named (the custom ops carry it as a str;
    # opcheck's schema check cannot multiply float8 tensors on the CPU, so uint8 it is).
    fp8_key, fp8_value = key.to(torch.float8_e4m3fn), value.to(torch.float8_e4m3fn)
    torch.library.opcheck(
        torch.ops.sparse_attn.qsa_sparse_attention.default,
        (query, fp8_key.view(torch.uint8), fp8_value.view(torch.uint8), ids, out, lse, None,
         None, None, None, None, None, None, None, None, None, None, None, None, "reference",
         False, False, None, None, 0.5, 2.0, torch.bfloat16, "fp8", None))
    torch.library.opcheck(torch.ops.sparse_attn.qsa_mqa_decode.default,
                          (q, cache.to(torch.float8_e4m3fn).view(torch.uint8), table, lens,
                           width, torch.empty((3, width), dtype=torch.float32), None, None,
                           "fp8", "reference"))


def test_opcheck_scores():
    q = randn((1, 9, 4, 128), torch.float16, "cpu")
    k = randn((1, 3, 128), torch.float16, "cpu")
    out = torch.empty((1, 9, 3), dtype=torch.float32)
    torch.library.opcheck(torch.ops.sparse_attn.qsa_indexer_mqa_score.default,
                          (q, k, out, None, None, None, None, None, None, None, 4, None, None,
                           None, "reference"))
    starts = torch.zeros(9, dtype=torch.int32)
    ends = torch.arange(9, dtype=torch.int32)
    out = torch.empty((9, 3), dtype=torch.float32)
    torch.library.opcheck(torch.ops.sparse_attn.qsa_mqa_prefill.default,
                          (q[0], k[0], starts, ends, out, None, 0.5, None, "reference"))


def test_opcheck_selection_and_xattn():
    scores = torch.randn(3, 20)
    torch.library.opcheck(torch.ops.sparse_attn.qsa_topk_blocks.default,
                          (scores, 4, torch.empty((3, 4), dtype=torch.int32)))
    blocks = torch.randint(-1, 5, (3, 4), dtype=torch.int32)
    positions = torch.tensor([3, 17, 25], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sparse_attn.qsa_expand_blocks.default,
                          (blocks, positions, torch.empty((3, 19), dtype=torch.int32),
                           torch.empty((3, 4), dtype=torch.int32)))
    q = randn((1, 2, 256, 32), torch.float32, "cpu")
    sums = torch.empty((1, 2, 2, 2))
    mask = torch.empty((1, 2, 2, 2), dtype=torch.bool)
    torch.library.opcheck(torch.ops.sparse_attn.xattn_estimate.default,
                          (q, q, sums, mask, 0.9, None, True, False, False, 128, 8, 1.0, 16384,
                           "inverse", "reference"))
    torch.library.opcheck(torch.ops.sparse_attn.xattention_prefill.default,
                          (q, q, q, sums, mask, torch.empty_like(q), None, 0.0, [0.5, 0.9],
                           True, True, False, 128, 8, 1.0, 16384, "inverse", None, "reference"))


def test_compiled_xattention_matches_eager():
    q = randn((1, 2, 256, 32), torch.float16, "cpu")

    def fn(q, k, v):
        return sparse_attn.Xattention_prefill(q, k, v, 8, backend="reference").float() + 1

    expected = fn(q, q, q)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, q, q)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def layer(query, key, value, ids, q_idx, cache, table, lens):
    # A decode step as a serving engine writes it: scores, then attention, then a gate-free
    # output projection stand-in; compiled as one graph.
    scores = sparse_attn.qsa_mqa_decode(q_idx, cache, table, lens, 32, backend="reference")
    out, lse = sparse_attn.qsa_sparse_attention(query, key, value, ids, return_lse=True,
                                                backend="reference")
    return out.float().sum(-1) * 2, lse, scores.clamp_min(-1e4)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_matches_eager(compiler):
    args = (*attention_inputs("cpu"), *decode_inputs("cpu", "reference")[:4])
    expected = layer(*args)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=compiler, fullgraph=True)
    got = compiled(*args)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_compiled_out_argument_is_written():
    query, key, value, ids = attention_inputs("cpu")
    expected = sparse_attn.qsa_sparse_attention(query, key, value, ids, backend="reference")

    def fn(out):
        sparse_attn.qsa_sparse_attention(query, key, value, ids, backend="reference", out=out)
        return out

    torch._dynamo.reset()
    out = torch.full_like(query, float("nan"))
    result = torch.compile(fn, backend="aot_eager", fullgraph=True)(out)
    assert torch.equal(out, expected) and torch.equal(result, expected)


# ------------------------------------------------------------------------------------------
# CUDA: streams and graphs, for every native op (the indexer, the selection helpers) and every
# native sparse-attention schedule (one split; SplitKV partials and the row-rank pass, whose
# scratch the wrapper allocates with torch when the op runs)
# ------------------------------------------------------------------------------------------

def paged_decode_inputs(device, token_to_req, width=2051):
    """Two decode rows, canonical geometry, paged K/V: the split heuristic picks SplitKV (4
    CTAs per split on a GPU of 100+ SMs), merged inside clusters on the gather kernel, or with
    more ids than its 16 splits of 2112 take (width 33793) in the per-row kernel's partials
    (the workspace)."""
    page, pages = 64, 12
    lens = torch.tensor([700, 431], dtype=torch.int32, device=device)
    query = randn((2, 24, 256), torch.bfloat16, device)
    key = randn((2 * pages, page, 2, 256), torch.bfloat16, device)
    value = randn((2 * pages, page, 2, 256), torch.bfloat16, device)
    table = torch.randperm(2 * pages, dtype=torch.int32).view(2, pages).to(device)
    ids = torch.randint(-1, 431, (2, width), dtype=torch.int32, device=device)
    rows = torch.arange(2, dtype=torch.int32, device=device)
    return query, key, value, ids, table, lens, rows


def native_calls():
    """(name, make_inputs(device), fn(*inputs), index of a K/V-like input the side-stream
    test writes right before the call). fn runs the op on the native backend."""
    def attention_padded():
        return attention_inputs("cuda")

    def run_attention_padded(q, k, v, i):
        return sparse_attn.qsa_sparse_attention(q, k, v, i, backend="native", num_splits=1)

    def run_attention_splitkv(q, k, v, i, table, lens, rows):
        return sparse_attn.qsa_sparse_attention(q, k, v, i, block_table=table, seq_lens_k=lens,
                                                cu_seqlens_q=torch.cat([rows, rows[-1:] + 1]),
                                                backend="native")

    def run_attention_token_to_req(q, k, v, i, table, lens, rows):
        # int64 request ids and positions, as engines keep them (read as stored, no copy).
        return sparse_attn.qsa_sparse_attention(q, k, v, i, block_table=table, seq_lens_k=lens,
                                                token_to_req=rows.long(),
                                                query_positions=(lens - 1).long(),
                                                backend="native")

    def run_decode(q, cache, table, lens):
        return sparse_attn.qsa_mqa_decode(q, cache, table, lens, 32, backend="native")

    def indexer():
        return (randn((1, 9, 4, 128), torch.bfloat16, "cuda"),
                randn((1, 3, 128), torch.bfloat16, "cuda"))

    def run_indexer(q, k):
        return sparse_attn.qsa_indexer_mqa_score(q, k, backend="native")

    def prefill():
        return (randn((9, 4, 128), torch.bfloat16, "cuda"), randn((5, 128), torch.bfloat16, "cuda"),
                torch.tensor([0, 0, 1, 0, 2, 3, 0, 4, 9], dtype=torch.int32, device="cuda"),
                torch.tensor([1, 2, 3, 5, 4, 5, 0, 5, 9], dtype=torch.int32, device="cuda"))

    def run_prefill(q, k, starts, ends):
        return sparse_attn.qsa_mqa_prefill(q, k, starts, ends, backend="native")

    def run_topk(scores):
        return sparse_attn.qsa_topk_blocks(scores, 16)

    def expand():
        return (torch.randint(-1, 50, (3, 16), dtype=torch.int32, device="cuda"),
                torch.tensor([3, 100, 250], dtype=torch.int32, device="cuda"))

    def run_expand(blocks, positions):
        return sparse_attn.qsa_expand_blocks(blocks, positions)

    return [
        pytest.param(attention_padded, run_attention_padded, 2, id="attention_padded_one_split"),
        pytest.param(lambda: paged_decode_inputs("cuda", False), run_attention_splitkv, 2,
                     id="attention_paged_splitkv"),
        pytest.param(lambda: paged_decode_inputs("cuda", False, 16 * 2112 + 1),
                     run_attention_splitkv, 2, id="attention_paged_splitkv_partials"),
        pytest.param(lambda: paged_decode_inputs("cuda", True), run_attention_token_to_req, 2,
                     id="attention_token_to_req_int64"),
        pytest.param(lambda: decode_inputs("cuda", "native")[:4], run_decode, 1,
                     id="indexer_mqa_decode"),
        pytest.param(indexer, run_indexer, 1, id="indexer_mqa_score"),
        pytest.param(prefill, run_prefill, 1, id="indexer_mqa_prefill"),
        # The selection helpers have no backend argument: CUDA tensors run native kernels.
        pytest.param(lambda: (torch.randn(3, 700, device="cuda"),), run_topk, 0,
                     id="select_topk_blocks"),
        pytest.param(expand, run_expand, 0, id="select_expand_blocks"),
    ]


def garbage_like(t):
    """Values no correct call could have read: NaN, or for ids one past any selection."""
    return torch.full_like(t, math.nan if t.is_floating_point() else 123456)


def fresh_like(t):
    """New random contents for a replay: floats, or ids in the range the inputs use."""
    if t.is_floating_point():
        return randn(t.shape, t.dtype, "cuda")
    return torch.randint(-1, 50, t.shape, dtype=t.dtype, device=t.device)


def run_attention_reference(q, k, v, i):
    return sparse_attn.qsa_sparse_attention(q, k, v, i, backend="reference")


@needs_cuda
@pytest.mark.parametrize("make,fn,late", native_calls() + [
    pytest.param(lambda: attention_inputs("cuda"), run_attention_reference, 2,
                 id="attention_reference_backend")])
def test_work_on_a_side_stream(make, fn, late):
    inputs = list(make())
    expected = call_native_or_skip(lambda: fn(*inputs), "native")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # An input produced on the side stream right before the call: a call issued on any
        # other stream would race with these kernels.
        good = inputs[late]
        inputs[late] = garbage_like(good)
        torch.cuda._sleep(50_000_000)
        inputs[late].copy_(good)
        out = fn(*inputs)
    side.synchronize()
    assert torch.equal(out, expected)


@needs_cuda
@pytest.mark.parametrize("make,fn,late", native_calls())
def test_cuda_graph_capture_and_replay(make, fn, late):
    inputs = make()
    call_native_or_skip(lambda: fn(*inputs), "native")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up outside capture
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        # Output and scratch come from the graph's private pool.
        out = fn(*inputs)
    first = inputs[0]
    before = fn(*inputs)
    # Replay consumes the current contents of the inputs.
    first.copy_(fresh_like(first))
    out.copy_(garbage_like(out))
    graph.replay()
    torch.cuda.synchronize()
    expected = fn(*inputs)
    assert not torch.equal(expected, before)
    assert torch.equal(out, expected)


@needs_cuda
def test_cuda_graph_replay_matches_the_reference():
    query, key, value, ids = attention_inputs("cuda")
    call_native_or_skip(
        lambda: sparse_attn.qsa_sparse_attention(query, key, value, ids, backend="native",
                                                 num_splits=1),
        "native")
    out = torch.empty_like(query)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            sparse_attn.qsa_sparse_attention(query, key, value, ids, backend="native",
                                             num_splits=1, out=out)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        sparse_attn.qsa_sparse_attention(query, key, value, ids, backend="native",
                                         num_splits=1, out=out)
    query.copy_(randn(query.shape, query.dtype, "cuda"))
    ids.copy_(torch.randint(-1, 32, ids.shape, dtype=torch.int32, device="cuda"))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    expected = sparse_attn.qsa_sparse_attention(query, key, value, ids, backend="reference")
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


@needs_cuda
@pytest.mark.parametrize("make,fn,late", native_calls())
def test_compiled_reduce_overhead_uses_cuda_graphs(make, fn, late):
    inputs = make()
    call_native_or_skip(lambda: fn(*inputs), "native")

    def step(*args):
        return fn(*args) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got = compiled(*inputs)
    expected = step(*inputs)
    assert torch.equal(got, expected)
    # A new step's inputs (same shapes) replay the graph, reading the new contents.
    inputs[0].copy_(fresh_like(inputs[0]))
    got = compiled(*inputs).clone()
    assert torch.equal(got, step(*inputs))
