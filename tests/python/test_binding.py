"""The binding's tensor conversion (DLPack -> TensorView: dtype, device, shape, strides and
the data pointer with the byte offset applied) and its error mapping."""

import numpy as np
import pytest
import torch

import sparse_attn
from sparse_attn import _C
from qsa_testing import DEVICES, needs_cuda

TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.int32: "int32", torch.int64: "int64", torch.bool: "bool"}


def info(t):
    dtype, device, shape, strides, ptr = _C.tensor_info(t)
    return dict(dtype=dtype, device=device, shape=tuple(shape), strides=tuple(strides), ptr=ptr)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=list(TORCH_DTYPES.values()))
def test_torch_views_keep_offset_and_strides(device, dtype):
    base = torch.zeros((4, 6, 8), dtype=dtype, device=device)
    views = [base, base[1:, 2:5, 1::3], base.transpose(0, 2), base[2], base[:, :1].expand(4, 5, 8),
             base[3:3]]
    for v in views:
        got = info(v)
        assert got["dtype"] == TORCH_DTYPES[dtype]
        assert got["device"] == ("cpu" if device == "cpu" else f"cuda:{v.get_device()}")
        assert got["shape"] == tuple(v.shape)
        if v.numel() > 1:
            assert got["strides"] == v.stride()
        assert got["ptr"] == v.data_ptr()


def test_numpy_views_keep_offset_and_strides():
    base = np.zeros((5, 7), dtype=np.float16)
    for v in (base, base[2:, 1::2], base.T, base[4]):
        got = info(v)
        assert got["dtype"] == "float16" and got["device"] == "cpu"
        assert got["shape"] == v.shape
        assert got["strides"] == tuple(s // v.itemsize for s in v.strides)
        assert got["ptr"] == v.ctypes.data


def test_numpy_negative_strides_are_refused():
    with pytest.raises(ValueError, match="negative strides"):
        _C.tensor_info(np.zeros((3, 2), dtype=np.float32)[::-1])


@pytest.mark.parametrize("value,dtype_name", [(torch.zeros(2, dtype=torch.float64), "float64"),
                                              (torch.zeros(2, dtype=torch.int8), "int8"),
                                              (np.zeros(2, dtype=np.int16), "int16")])
def test_unsupported_dtypes_are_type_errors(value, dtype_name):
    with pytest.raises(TypeError, match=f"^tensor: tensors of dtype {dtype_name} are not"):
        _C.tensor_info(value)


def test_more_than_six_dimensions_is_a_value_error():
    with pytest.raises(ValueError, match="at most 6 dimensions"):
        _C.tensor_info(torch.zeros((1,) * 7))


@pytest.mark.parametrize("value", [1.5, 3, None, "x", [1.0, 2.0]])
def test_non_tensors_are_type_errors(value):
    with pytest.raises(TypeError, match="^tensor: expected a tensor"):
        _C.tensor_info(value)


def test_not_supported_error_is_a_value_error():
    assert issubclass(sparse_attn.NotSupportedError, ValueError)


@needs_cuda
def test_cuda_tensor_on_second_device_reports_its_index():
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device")
    assert info(torch.zeros(3, device="cuda:1"))["device"] == "cuda:1"


class DLPackOnly:
    """A producer with nothing but the DLPack protocol (no array namespace)."""

    def __init__(self, array):
        self.array = array
        self.shape = array.shape

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_any_dlpack_producer_and_torch_subclasses():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)[1:, ::2]
    assert info(DLPackOnly(base))["ptr"] == base.ctypes.data
    param = torch.nn.Parameter(torch.zeros(3, 5), requires_grad=False)
    assert info(param[:, 1:])["ptr"] == param[:, 1:].data_ptr()


def test_outputs_of_bare_dlpack_producers_need_out():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 128)).astype(np.float16)
    k = rng.standard_normal((3, 128)).astype(np.float16)
    starts, ends = np.zeros(2, dtype=np.int32), np.full(2, 3, dtype=np.int32)
    with pytest.raises(TypeError, match="^q: cannot allocate .* pass out="):
        sparse_attn.qsa_mqa_prefill(DLPackOnly(q), k, starts, ends, backend="reference")
    out = np.full((2, 3), np.nan, dtype=np.float32)
    result = sparse_attn.qsa_mqa_prefill(DLPackOnly(q), DLPackOnly(k), starts, ends,
                                         backend="reference", out=out)
    assert result is out
    expected = sparse_attn.qsa_mqa_prefill(q, k, starts, ends, backend="reference")
    assert np.array_equal(out, expected)


def test_package_works_without_torch():
    # torch is optional: with it unimportable, numpy inputs still work end to end.
    import os
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, sparse_attn\n"
            "q = np.ones((2, 4, 128), np.float16); k = np.ones((3, 128), np.float16)\n"
            "out = sparse_attn.qsa_mqa(q, k, np.zeros(2, np.int32), np.full(2, 3, np.int32),\n"
            "                          backend='reference')\n"
            "assert isinstance(out, np.ndarray) and out.shape == (2, 3)\n"
            "assert abs(float(out[0, 0]) - 4 * 128 / 128 ** 0.5) < 1e-3\n")
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_python_output_shapes_agree_with_the_cpp_shape_functions():
    # The wrappers compute output shapes in Python (so that torch.compile can trace them);
    # the C++ *_shape functions are the definition.
    bf = torch.bfloat16
    q_idx, keys = torch.zeros((2, 5, 4, 128), dtype=bf), torch.zeros((2, 3, 128), dtype=bf)
    assert sparse_attn.qsa_indexer_mqa_score(q_idx, keys, backend="reference").shape == \
        tuple(_C.qsa_indexer_mqa_score_shape(q_idx, keys, None, None, None, None, None, None,
                                             None, 4, None, None, None, "reference"))
    cache, table = torch.zeros((4, 8, 1, 128), dtype=bf), torch.zeros((2, 3), dtype=torch.int32)
    assert sparse_attn.qsa_indexer_mqa_score(q_idx, cache, block_table=table,
                                             backend="reference").shape == \
        tuple(_C.qsa_indexer_mqa_score_shape(q_idx, cache, table, None, None, None, None, None,
                                             None, 4, None, None, None, "reference"))
    q, k = torch.zeros((6, 4, 128), dtype=bf), torch.zeros((9, 1, 128), dtype=bf)
    rows = torch.zeros(6, dtype=torch.int32)
    assert sparse_attn.qsa_mqa_prefill(q, k, rows, rows, backend="reference").shape == \
        tuple(_C.qsa_mqa_prefill_shape(q, k, None))
    assert sparse_attn.qsa_mqa_decode(q, cache, table[:, :1].repeat(3, 1), rows, 17,
                                      backend="reference").shape == \
        tuple(_C.qsa_mqa_decode_shape(q, 17))
    query = torch.zeros((2, 3, 4, 32), dtype=bf)
    kv = torch.zeros((2, 8, 2, 32), dtype=bf)
    ids = torch.zeros((2, 3, 5), dtype=torch.int32)
    out, lse = sparse_attn.qsa_sparse_attention(query, kv, kv, ids, return_lse=True,
                                                backend="reference")
    assert out.shape == tuple(_C.qsa_sparse_attention_out_shape(query))
    assert lse.shape == tuple(_C.qsa_sparse_attention_lse_shape(query))
    scores = torch.zeros((2, 3, 40))
    assert sparse_attn.qsa_topk_blocks(scores, 7).shape == \
        tuple(_C.qsa_topk_blocks_shape(scores, 7))
    blocks = torch.zeros((2, 3, 7), dtype=torch.int32)
    assert sparse_attn.qsa_expand_blocks(blocks, torch.zeros((2, 3), dtype=torch.int32)).shape \
        == tuple(_C.qsa_expand_blocks_token_shape(blocks))
    qs, ks = torch.zeros((1, 4, 300, 16)), torch.zeros((1, 2, 700, 16))
    assert sparse_attn.xattn_estimate(qs, ks, 128, 8, backend="reference")[0].shape == \
        tuple(_C.xattn_estimate_shape(qs, ks, 128))
