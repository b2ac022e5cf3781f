"""The fused selections (qsa_indexer_select, qsa_mqa_decode_select) through the Python API
against their composition: the score op, qsa_topk_blocks, qsa_expand_blocks at each row's
position and a count made here (docs/qsa.md, "Fused selection"); the return flags, given
outputs, budgets, numpy inputs, the torch custom ops, and errors naming the argument. CUDA
cases run native against the same composition where there is a GPU."""

import numpy as np
import pytest
import torch

import sparse_attn
from qsa_testing import DEVICES, expand_blocks, needs_cuda, randn

I32 = torch.int32


def composition(scores, k, row_pos):
    """(ids, tokens, counts) of FP32 scores [.., N] with row_pos (-1: a padding row)."""
    ids = sparse_attn.qsa_topk_blocks(scores.cpu(), k).reshape(-1, k)
    for r, p in enumerate(row_pos):
        if p < 0:
            ids[r] = -1
    tokens, _ = expand_blocks(ids, row_pos)
    return ids, tokens, (tokens >= 0).sum(-1).to(I32)


def quantised(shape, dtype, device):
    # Small integers: many equal scores, which must go to the lower block id.
    return torch.randint(-2, 3, shape).to(dtype).to(device)


def indexer_call(form, device):
    """(args, kwargs, row_pos) of a qsa_indexer_mqa_score call in one of its forms."""
    B, Q, N, D = 2, 9, 14, 128
    kw = {}
    if form.startswith("padded"):
        q = quantised((B, Q, 4, D), torch.bfloat16, device)
        pos = torch.randint(-2, 4 * N + 4, (B, Q), dtype=I32)
        kw["query_positions"] = pos.to(device)
        kw["seq_lens_q"] = torch.tensor([Q, 4], dtype=I32, device=device)
        row_pos = [p if i < (Q if b == 0 else 4) and p >= 0 else -1
                   for b in range(B) for i, p in enumerate(pos[b].tolist())]
    else:
        q = quantised((B * Q, 4, D), torch.bfloat16, device)
        req = torch.randint(-1, B, (B * Q,), dtype=I32)  # -1: padding rows
        pos = torch.randint(-2, 4 * N + 4, (B * Q,), dtype=torch.int64)
        kw.update(token_to_req=req.to(device), query_positions=pos.to(device))
        row_pos = [p if r >= 0 and p >= 0 else -1 for r, p in zip(req.tolist(), pos.tolist())]
    if form.endswith("paged"):
        page = 4
        keys = quantised((8, page, 1, D), torch.bfloat16, device)
        kw["block_table"] = torch.tensor([[0, 1, -1, 7], [3, 9, 2, 5]], dtype=I32, device=device)
        N = 4 * page
    else:
        keys = quantised((B, N, D), torch.bfloat16, device)
    if form.endswith("fp8"):
        keys = keys.to(torch.float8_e4m3fn).view(torch.uint8)
        kw["kv_cache_dtype"] = "fp8"
    return (q, keys), kw, row_pos, N


FORMS = ["padded", "padded_paged", "varlen", "varlen_paged", "padded_fp8"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("k", [1, 5, 20])
def test_indexer_select_equals_the_composition(device, form, k):
    args, kw, row_pos, N = indexer_call(form, device)
    backends = ["reference", "native"]
    for backend in backends:
        scores = sparse_attn.qsa_indexer_mqa_score(*args, **kw, backend=backend)
        want = composition(scores, k, row_pos)
        for budget in (None, 4 * N, 12 * N + 5):
            ids, tokens, counts = sparse_attn.qsa_indexer_select(
                *args, k, **kw, backend=backend, return_tokens=True, return_valid_counts=True,
                max_workspace_bytes=budget)
            assert ids.dtype == I32 and ids.device == args[0].device
            assert ids.shape == (*scores.shape[:-1], k)
            assert tokens.shape == (*scores.shape[:-1], 4 * k + 3)
            assert counts.shape == scores.shape[:-1]
            for got, expected in zip((ids, tokens, counts), want):
                assert torch.equal(got.cpu().reshape(expected.shape), expected), (backend, budget)


def decode_call(device, R):
    B, page, width = 4, 8, 40
    q = quantised((B, R, 4, 128) if R > 1 else (B, 4, 128), torch.bfloat16, device)
    cache = quantised((6, page, 128), torch.bfloat16, device)
    table = torch.tensor([[0, 1, 2, -1, 4], [5, 4, 3, 2, 1], [-1, 9, 0, 1, 2], [1, 1, 1, 1, 1]],
                         dtype=I32, device=device)
    shape = (B, R) if R > 1 else (B,)
    lens = torch.randint(-1, width + 5, shape, dtype=I32)
    lens.view(-1)[0] = 0
    pos = torch.randint(-2, 4 * width, shape, dtype=torch.int64)
    row_pos = [p if n > 0 and p >= 0 else -1
               for n, p in zip(lens.reshape(-1).tolist(), pos.reshape(-1).tolist())]
    return (q, cache, table, lens.to(device), width), pos.to(device), row_pos


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("R", [1, 3])
def test_decode_select_equals_the_composition(device, R):
    args, pos, row_pos = decode_call(device, R)
    for backend in ("reference", "native"):
        scores = sparse_attn.qsa_mqa_decode(*args, backend=backend)
        for k in (1, 7, 64):
            want = composition(scores, k, row_pos)
            for budget in (None, 4 * args[-1]):
                got = sparse_attn.qsa_mqa_decode_select(
                    *args, k, query_positions=pos, backend=backend, return_tokens=True,
                    return_valid_counts=True, max_workspace_bytes=budget)
                for g, e in zip(got, want):
                    assert torch.equal(g.cpu().reshape(e.shape), e), (backend, k, budget)
            # Without positions: the block ids only (padding by context_lens alone).
            ids = sparse_attn.qsa_mqa_decode_select(*args, k, backend=backend)
            lens = args[3].reshape(-1).cpu()
            only = composition(scores, k, [0 if n > 0 else -1 for n in lens.tolist()])[0]
            assert torch.equal(ids.cpu(), only)


def test_return_flags_and_given_outputs():
    args, kw, row_pos, N = indexer_call("padded", "cpu")
    ids = sparse_attn.qsa_indexer_select(*args, 4, **kw)
    assert isinstance(ids, torch.Tensor) and ids.shape == (2, 9, 4)
    ids2, tokens = sparse_attn.qsa_indexer_select(*args, 4, **kw, return_tokens=True)
    ids3, counts = sparse_attn.qsa_indexer_select(*args, 4, **kw, return_valid_counts=True)
    assert torch.equal(ids, ids2) and torch.equal(ids, ids3)
    assert torch.equal(counts, (tokens >= 0).sum(-1).to(I32))
    # Given outputs are written and returned as those objects; without the flag a given
    # output is written but not returned.
    out = torch.full((2, 9, 4), 7, dtype=I32)
    tok = torch.full((2, 9, 19), 7, dtype=I32)
    cnt = torch.full((2, 9), 7, dtype=I32)
    result = sparse_attn.qsa_indexer_select(*args, 4, **kw, out=out, token_indices=tok,
                                            valid_counts=cnt, return_tokens=True)
    assert result[0] is out and result[1] is tok and len(result) == 2
    assert torch.equal(out, ids) and torch.equal(tok, tokens) and torch.equal(cnt, counts)
    # The default topk is 512 (k > N_B pads with -1).
    assert sparse_attn.qsa_indexer_select(*args, **kw).shape == (2, 9, 512)


def test_ties_keep_the_lowest_ids():
    q = torch.zeros((1, 3, 4, 128), dtype=torch.bfloat16)
    keys = randn((1, 10, 128), torch.bfloat16, "cpu")
    pos = torch.tensor([[39, 11, 2]], dtype=I32)
    ids = sparse_attn.qsa_indexer_select(q, keys, 4, query_positions=pos)
    assert ids.tolist() == [[[0, 1, 2, 3], [0, 1, 2, -1], [-1, -1, -1, -1]]]


def test_numpy_inputs():
    q = np.zeros((4, 4, 16), dtype=np.float16)
    keys = np.ones((1, 3, 16), dtype=np.float16)
    cu = np.array([0, 4], dtype=np.int32)
    ids, counts = sparse_attn.qsa_indexer_select(q, keys, 2, cu_seqlens_q=cu,
                                                 return_valid_counts=True, backend="reference")
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int32
    assert ids.tolist() == [[-1, -1], [-1, -1], [-1, -1], [0, -1]]  # row 3 sees block 0
    assert counts.tolist() == [1, 2, 3, 4]


def test_workspace_sizes_are_zero_on_the_cpu():
    args, kw, _, _ = indexer_call("varlen", "cpu")
    assert sparse_attn.qsa_indexer_select_workspace_size(*args, 8, **kw, return_tokens=True) == 0
    dargs, pos, _ = decode_call("cpu", 3)
    assert sparse_attn.qsa_mqa_decode_select_workspace_size(
        *dargs, 8, query_positions=pos, return_valid_counts=True) == 0


def test_errors_name_the_argument():
    args, kw, _, N = indexer_call("padded", "cpu")
    with pytest.raises(ValueError, match="^topk:"):
        sparse_attn.qsa_indexer_select(*args, 0, **kw)
    with pytest.raises(TypeError, match="^topk:"):
        sparse_attn.qsa_indexer_select(*args, 1.5, **kw)
    with pytest.raises(ValueError, match="^out:"):
        sparse_attn.qsa_indexer_select(*args, 4, **kw, out=torch.empty((2, 9, 5), dtype=I32))
    with pytest.raises(TypeError, match="^out:"):
        sparse_attn.qsa_indexer_select(*args, 4, **kw, out=torch.empty((2, 9, 4)))
    with pytest.raises(ValueError, match="^token_indices:"):
        sparse_attn.qsa_indexer_select(*args, 4, **kw,
                                       token_indices=torch.empty((2, 9, 18), dtype=I32))
    with pytest.raises(ValueError, match="^max_workspace_bytes:"):
        sparse_attn.qsa_indexer_select(*args, 4, **kw, max_workspace_bytes=4 * N - 1)
    with pytest.raises(ValueError, match="^max_workspace_bytes:"):
        sparse_attn.qsa_indexer_select(*args, 4, **kw, max_workspace_bytes=-1)
    with pytest.raises(TypeError, match="^return_tokens:"):
        sparse_attn.qsa_indexer_select(*args, 4, **kw, return_tokens=1)
    with pytest.raises(TypeError, match="^workspace:"):
        sparse_attn.qsa_indexer_select(*args, 4, **kw, workspace=torch.empty(64))
    shared = torch.empty(2 * 9 * 4, dtype=I32)
    with pytest.raises(ValueError, match="^valid_counts:"):
        sparse_attn.qsa_indexer_select(*args, 4, **kw, out=shared.view(2, 9, 4),
                                       valid_counts=shared[:18].view(2, 9))
    dargs, pos, _ = decode_call("cpu", 3)
    with pytest.raises(ValueError, match="^query_positions:"):
        sparse_attn.qsa_mqa_decode_select(*dargs, 4, return_tokens=True)
    with pytest.raises(ValueError, match="^query_positions:"):
        sparse_attn.qsa_mqa_decode_select(*dargs, 4, query_positions=pos.reshape(-1))
    with pytest.raises(ValueError, match="^context_lens:"):
        sparse_attn.qsa_mqa_decode_select(dargs[0], dargs[1], dargs[2], dargs[3][:, 0],
                                          dargs[4], 4)


def test_torch_custom_ops():
    args, kw, _, _ = indexer_call("padded", "cpu")
    out, tok, cnt = (torch.empty((2, 9, 4), dtype=I32), torch.empty((2, 9, 19), dtype=I32),
                     torch.empty((2, 9), dtype=I32))
    torch.library.opcheck(torch.ops.sparse_attn.qsa_indexer_select.default,
                          (*args, 4, out, tok, cnt, None, None, None, None, None,
                           kw["query_positions"], kw["seq_lens_q"], 4, None, None, None,
                           "reference", None, None))
    dargs, pos, _ = decode_call("cpu", 3)
    torch.library.opcheck(torch.ops.sparse_attn.qsa_mqa_decode_select.default,
                          (*dargs, 4, torch.empty((12, 4), dtype=I32),
                           torch.empty((12, 19), dtype=I32), None, pos, None, None, None,
                           "native", 160, None))

    @torch.compile(fullgraph=True, backend="eager")
    def select(q, keys, pos):
        return sparse_attn.qsa_indexer_select(q, keys, 4, query_positions=pos,
                                              return_tokens=True)

    got = select(args[0], args[1], kw["query_positions"])
    want = sparse_attn.qsa_indexer_select(args[0], args[1], 4,
                                          query_positions=kw["query_positions"],
                                          return_tokens=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_cuda
@pytest.mark.skipif(not sparse_attn.built_with_cuda, reason="built without CUDA")
def test_cuda_workspace_and_graph_replay():
    args, kw, row_pos, N = indexer_call("varlen_paged", "cuda")
    size = sparse_attn.qsa_indexer_select_workspace_size(*args, 16, **kw, return_tokens=True,
                                                         max_workspace_bytes=4 * N * 7)
    workspace = torch.empty(max(size, 16), dtype=torch.uint8, device="cuda")
    out = torch.full((18, 16), 0x7f7f7f7f, dtype=I32, device="cuda")
    tok = torch.full((18, 67), 0x7f7f7f7f, dtype=I32, device="cuda")

    def call():
        sparse_attn.qsa_indexer_select(*args, 16, **kw, out=out, token_indices=tok,
                                       max_workspace_bytes=4 * N * 7, workspace=workspace)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    new_pos = torch.randint(-2, 4 * N + 4, kw["query_positions"].shape, dtype=torch.int64)
    kw["query_positions"].copy_(new_pos)
    out.fill_(0x7f7f7f7f)
    graph.replay()
    torch.cuda.synchronize()
    req = kw["token_to_req"].cpu().tolist()
    row_pos = [p if r >= 0 and p >= 0 else -1 for r, p in zip(req, new_pos.tolist())]
    scores = sparse_attn.qsa_indexer_mqa_score(*args, **kw, backend="reference")
    ids, tokens, _ = composition(scores, 16, row_pos)
    assert torch.equal(out.cpu(), ids) and torch.equal(tok.cpu(), tokens)
