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
                                              (torch.zeros(2, dtype=torch.uint8), "uint8"),
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
