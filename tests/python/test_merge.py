"""merge_attention_states through the Python API against the float64 statement of docs/merge.md
(qsa_testing.ref_merge): every dtype combination, N from 1 to 64, empty and NaN rows, given
and strided outputs, numpy inputs, the split identity with qsa_sparse_attention, the torch
custom op, and errors naming the argument."""

import math

import numpy as np
import pytest
import torch

import sparse_attn
from qsa_testing import DEVICES, FLOAT_DTYPES, assert_close, randn, ref_merge

OUT_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
LSE_TOL = 1e-5
BACKENDS = ["reference", "native"]  # native on CPU tensors: the CPU backend


def random_states(n, rows, heads, dim, dtype, device, empty=0.25):
    """Partial states as a split of attention leaves them: LSEs in [-4, 6], about `empty` of the
    partials (and all of row 0) empty: LSE -inf, output NaN (never written)."""
    po = randn((n, rows, heads, dim), dtype, "cpu")
    lse = (torch.rand((n, rows, heads), dtype=torch.float64) * 10 - 4).float()
    mask = torch.rand((n, rows, heads)) < empty
    mask[:, 0] = True
    lse[mask] = -math.inf
    po[mask] = math.nan
    return po.to(device), lse.to(device)


def check(out, lse, po, pl):
    ref_out, ref_lse = ref_merge(po, pl)
    tol = OUT_TOL[out.dtype]
    assert_close(out, ref_out, rtol=tol, atol=tol)
    assert_close(lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 5, 64])
@pytest.mark.parametrize("partial", FLOAT_DTYPES, ids=list(FLOAT_DTYPES))
def test_matches_the_definition(device, backend, n, partial):
    po, pl = random_states(n, 7, 3, 40, FLOAT_DTYPES[partial], device)
    out, lse = sparse_attn.merge_attention_states(po, pl, backend=backend)
    assert out.dtype == po.dtype and out.device == po.device and out.shape == (7, 3, 40)
    assert lse.dtype == torch.float32 and lse.shape == (7, 3)
    check(out, lse, po, pl)
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("partial", FLOAT_DTYPES, ids=list(FLOAT_DTYPES))
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=list(FLOAT_DTYPES))
def test_out_of_another_dtype(device, backend, partial, out_dtype):
    po, pl = random_states(4, 6, 2, 24, FLOAT_DTYPES[partial], device)
    out = torch.empty((6, 2, 24), dtype=FLOAT_DTYPES[out_dtype], device=device)
    result, lse = sparse_attn.merge_attention_states(po, pl, out=out, backend=backend)
    assert result is out
    check(out, lse, po, pl)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_given_strided_outputs_and_inputs(device, backend):
    n, rows, heads, dim = 3, 5, 4, 16
    po, pl = random_states(n, rows, heads, dim, torch.bfloat16, device)
    # Inputs as views: partial_out stored [rows, N, heads, 2 dim] (every other feature),
    # partial_lse with heads outermost.
    po_view = torch.empty((rows, n, heads, 2 * dim), dtype=po.dtype,
                          device=device)[..., ::2].transpose(0, 1)
    po_view.copy_(po)
    pl_view = torch.empty((heads, n, rows), device=device).permute(1, 2, 0)
    pl_view.copy_(pl)
    out_base = torch.full((rows, heads, 2 * dim + 1), math.nan, dtype=torch.float16, device=device)
    lse_base = torch.full((heads, rows + 1), math.nan, device=device)
    out, lse = out_base[..., 1::2], lse_base[:, 1:].t()
    result = sparse_attn.merge_attention_states(po_view, pl_view, out=out, lse_out=lse,
                                                backend=backend)
    assert result[0] is out and result[1] is lse
    check(out, lse, po, pl)
    assert out_base[..., ::2].isnan().all() and lse_base[:, 0].isnan().all()


def test_lse_out_is_written_without_return_lse():
    po, pl = random_states(2, 3, 2, 8, torch.float32, "cpu")
    lse = torch.full((3, 2), math.nan)
    out = sparse_attn.merge_attention_states(po, pl, lse_out=lse, return_lse=False)
    assert isinstance(out, torch.Tensor)
    check(out, lse, po, pl)
    only_out = sparse_attn.merge_attention_states(po, pl, return_lse=False)
    assert torch.equal(only_out, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_partial_with_garbage_and_nan_rows(backend):
    po, pl = random_states(4, 6, 2, 8, torch.float16, "cpu", empty=0.0)
    pl[1] = -math.inf
    po[1] = torch.tensor([math.nan, math.inf, -math.inf, 6e4]).repeat(2)  # never read
    pl[2, 2, 0] = math.nan
    pl[0, 3, 1] = math.inf
    out, lse = sparse_attn.merge_attention_states(po, pl, backend=backend)
    check(out, lse, po, pl)
    assert out[2, 0].isnan().all() and lse[2, 0].isnan()
    assert out[3, 1].isnan().all() and lse[3, 1].isnan()
    # Without the empty partial: the same bits.
    keep = torch.tensor([0, 2, 3])
    again, again_lse = sparse_attn.merge_attention_states(po[keep], pl[keep], backend=backend)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), again_lse.view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_inputs(backend):
    po, pl = random_states(3, 4, 2, 8, torch.float32, "cpu")
    out, lse = sparse_attn.merge_attention_states(po.numpy(), pl.numpy(), backend=backend)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (4, 2, 8)
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32
    check(torch.from_numpy(out), torch.from_numpy(lse), po, pl)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_of_a_split_is_attention_over_the_union(device):
    # SplitKV and context parallelism in one line: attention over three disjoint parts of each
    # row's selection, merged, is attention over the whole selection.
    rows, hq, hkv, d, total, width = 6, 4, 2, 32, 40, 15
    q = randn((rows, hq, d), torch.bfloat16, device)
    k, v = randn((total, hkv, d), torch.bfloat16, device), randn((total, hkv, d), torch.bfloat16,
                                                                 device)
    ids = torch.randint(-2, total + 2, (rows, width), dtype=torch.int32, device=device)
    ids[4] = -1  # an empty row
    ids[2, 5:10] = -1  # an empty part
    whole, whole_lse = sparse_attn.qsa_sparse_attention(
        q, k, v, selected_kv_indices=ids, return_lse=True, backend="reference")
    parts = [torch.where((torch.arange(width, device=device) // 5 == p)[None], ids, -1)
             for p in range(3)]
    states = [sparse_attn.qsa_sparse_attention(q, k, v, selected_kv_indices=s, return_lse=True,
                                               backend="reference") for s in parts]
    assert states[1][1][2].eq(-math.inf).all()
    po = torch.stack([o for o, _ in states])
    pl = torch.stack([lse for _, lse in states])
    for backend in BACKENDS:
        out, lse = sparse_attn.merge_attention_states(po, pl, backend=backend)
        assert_close(out, whole, rtol=2e-2, atol=2e-2)
        assert_close(lse, whole_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_reruns_are_bitwise_equal(device):
    po, pl = random_states(9, 33, 4, 128, torch.bfloat16, device)
    for backend in BACKENDS:
        a = sparse_attn.merge_attention_states(po, pl, backend=backend)
        b = sparse_attn.merge_attention_states(po, pl, backend=backend)
        assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
        assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_sized_axes(backend):
    for shape in [(2, 0, 3, 4), (2, 3, 0, 4)]:
        out, lse = sparse_attn.merge_attention_states(torch.zeros(shape), torch.zeros(shape[:3]),
                                                      backend=backend)
        assert out.shape == shape[1:] and lse.shape == shape[1:3]
    # No features: the LSE of the union is still written.
    po, pl = random_states(3, 4, 2, 1, torch.float32, "cpu")
    out, lse = sparse_attn.merge_attention_states(po[..., :0], pl, backend=backend)
    assert out.shape == (4, 2, 0)
    assert_close(lse, ref_merge(po, pl)[1], rtol=LSE_TOL, atol=LSE_TOL)


def test_custom_op_and_compile():
    po, pl = random_states(3, 5, 2, 16, torch.bfloat16, "cpu")
    out = torch.empty((5, 2, 16), dtype=torch.bfloat16)
    lse = torch.empty((5, 2))
    torch.library.opcheck(torch.ops.sparse_attn.merge_attention_states.default,
                          (po, pl, out, lse, "reference"))

    def fn(po, pl):
        o, l = sparse_attn.merge_attention_states(po, pl, backend="reference")
        return o.float() * 2, l + 1

    expected = fn(po, pl)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(po, pl)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------

def test_errors_name_the_argument():
    po, pl = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)
    merge = sparse_attn.merge_attention_states
    cases = [
        (TypeError, "partial_out", lambda: merge(po.double(), pl)),
        (TypeError, "partial_out", lambda: merge(po.int(), pl)),
        (TypeError, "partial_out", lambda: merge(1.5, pl)),
        (ValueError, "partial_out", lambda: merge(po[0], pl)),
        (ValueError, "partial_out", lambda: merge(po[:0], pl[:0])),
        (TypeError, "partial_lse", lambda: merge(po, pl.bfloat16())),
        (TypeError, "partial_lse", lambda: merge(po, None)),
        (ValueError, "partial_lse", lambda: merge(po, pl[:1])),
        (ValueError, "partial_lse", lambda: merge(po, pl[..., :3])),
        (TypeError, "out", lambda: merge(po, pl, out=torch.empty(3, 4, 8, dtype=torch.int32))),
        (ValueError, "out", lambda: merge(po, pl, out=torch.empty(3, 4, 9))),
        (ValueError, "out", lambda: merge(po, pl, out=torch.empty(1, 4, 8).expand(3, 4, 8))),
        (ValueError, "out", lambda: merge(po, pl, out=po[0, :, :, :8].reshape(3, 4, 8))),
        (TypeError, "lse_out", lambda: merge(po, pl, lse_out=torch.empty(3, 4).bfloat16())),
        (ValueError, "lse_out", lambda: merge(po, pl, lse_out=torch.empty(3, 5))),
        (ValueError, "lse_out", lambda: merge(po, pl, lse_out=pl[0])),
        (TypeError, "return_lse", lambda: merge(po, pl, return_lse=1)),
        (ValueError, "backend", lambda: merge(po, pl, backend="cuda")),
    ]
    for kind, name, call in cases:
        with pytest.raises(kind, match=f"^{name}:"):
            call()


def test_lse_out_may_not_alias_out():
    po, pl = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)
    out = torch.empty(3, 4, 8)
    with pytest.raises(ValueError, match="^lse_out:"):
        sparse_attn.merge_attention_states(po, pl, out=out, lse_out=out[..., 0])


def test_read_only_numpy_out_is_refused():
    po, pl = np.zeros((2, 3, 4, 8), np.float32), np.zeros((2, 3, 4), np.float32)
    out = np.zeros((3, 4, 8), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^out"):
        sparse_attn.merge_attention_states(po, pl, out=out)
