"""Framework glue shared by the op wrappers: output allocation, the caller's stream, and
the choice between the direct binding call and the torch custom op (under torch.compile)."""

from . import _C

try:
    import torch
except ImportError:  # numpy and other DLPack producers work without torch
    torch = None

try:
    import numpy
except ImportError:
    numpy = None

if torch is not None:
    _Tensor = torch.Tensor
    _TORCH_DTYPES = {"float32": torch.float32, "int32": torch.int32, "bool": torch.bool,
                     "uint8": torch.uint8}
    _is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    # The raw-stream getter is what torch's own compiled code calls: it skips building a
    # torch.cuda.Stream object on every call.
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
else:
    _Tensor = ()
    _is_compiling = None
    _raw_stream = None

# Set by _torch_ops once the custom ops are registered.
ops_registered = False


def describe(obj):
    return "None" if obj is None else type(obj).__qualname__


def require_tensor(obj, name):
    """TypeError naming `name` unless obj is something the binding can import as a tensor.

    Used only where Python must inspect an argument before the binding sees it (to allocate
    an output like it)."""
    if hasattr(obj, "__dlpack__") or (numpy is not None and isinstance(obj, numpy.ndarray)):
        return
    raise TypeError(
        f"{name}: expected a tensor (torch.Tensor, numpy.ndarray or any object with "
        f"__dlpack__), got {describe(obj)}"
    )


def require_bool(value, name):
    """TypeError unless value is a bool: flags that only Python reads (they choose what is
    returned) get the check the binding gives the others."""
    if value is not True and value is not False:
        raise TypeError(f"{name}: expected a bool, got {describe(value)}")


def empty(shape, like, name, dtype=None):
    """An uninitialised contiguous output of `shape` in the framework and on the device of
    `like`; dtype None means like's dtype, otherwise a name ("float32", "int32", "bool",
    "uint8")."""
    if isinstance(like, _Tensor):
        return torch_empty(shape, like, like.dtype if dtype is None else _TORCH_DTYPES[dtype])
    if numpy is not None and isinstance(like, numpy.ndarray):
        return numpy.empty(shape, dtype=like.dtype if dtype is None else dtype)
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is not None:  # cupy, jax and other array-API producers
        xp = namespace()
        return xp.empty(
            shape, dtype=like.dtype if dtype is None else getattr(xp, dtype), device=like.device
        )
    require_tensor(like, name)
    raise TypeError(
        f"{name}: cannot allocate an output like a {describe(like)} (it has __dlpack__ but no "
        f"array namespace); pass out="
    )


# What allocators raise for a size they cannot provide: torch's RuntimeError (out of memory, a
# storage size past int64, a negative size) and TypeError (a size past int64), numpy's
# MemoryError and ValueError.
ALLOCATION_ERRORS = (RuntimeError, MemoryError, ValueError, TypeError, OverflowError)


def explain_allocation_failure(error, outputs, validate):
    """Raises the error of a call whose output allocation failed with `error`.

    The wrappers allocate outputs before the binding validates the call, which keeps a call to
    one binding call; the sizes come from the arguments, so a malformed call (k=-1, a wrong
    dtype or a wrong lse= next to a broadcast input of 2**40 rows) can fail in the allocator
    first. Here the binding validates it after all: validate(placeholder) runs the op's binding
    with _C.MISSING_OUTPUT in place of each output named in `outputs` (those the wrapper had
    to allocate) and the given outputs as given. The C++ op skips the checks of a missing
    output, checks every other argument (the inputs, then the given outputs), and only then
    raises a ValueError naming the first missing one (src/api/check.h). So the rule is: an
    error naming one of `outputs` means everything the caller passed is well-formed, and the
    allocation failure stands; any other ValueError or TypeError (naming an input or a given
    output) is the call's own. (An empty tensor as the placeholder would not do: its own shape
    check could fail before a malformed given output is looked at.) Only this failure path
    makes the extra binding call."""
    if _is_compiling is not None and _is_compiling():
        raise error  # fake tensors cannot reach the binding
    try:
        validate(_C.MISSING_OUTPUT)
    except (ValueError, TypeError) as e:
        if not str(e).startswith(tuple(f"{name}:" for name in outputs)):
            raise e from None
    raise error


def torch_empty(shape, like, dtype):
    """A contiguous torch tensor of `shape` and `dtype` on like's device. The sizes go in as
    separate ints: torch parses them about 0.5 us faster than one tuple or torch.Size
    (development machine, CPU)."""
    if len(shape) == 0:
        return torch.empty((), dtype=dtype, device=like.device)
    return torch.empty(*shape, dtype=dtype, device=like.device)


def workspace_allocator(like):
    """What the binding calls, with a byte count, when a call needs scratch memory: a uint8
    buffer in like's framework on like's device (for torch, the caching allocator, which
    CUDA graph capture and torch.compile understand)."""
    if isinstance(like, _Tensor):
        device = like.device
        return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device)
    return lambda nbytes: empty((nbytes,), like, "workspace", "uint8")


def torch_stream(tensor):
    """The current CUDA stream of tensor's device as an int, or None for CPU tensors."""
    if not tensor.is_cuda:
        return None
    index = tensor.get_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def run(binding, op_name, like, args):
    """Calls binding(*args, stream). Torch tensors run on torch's current stream; under
    torch.compile the call goes through torch.ops.sparse_attn.<op_name> (same arguments, the
    stream is found when the op runs), so graphs capture it as one opaque op."""
    if isinstance(like, _Tensor):
        if ops_registered and _is_compiling():
            getattr(torch.ops.sparse_attn, op_name)(*args)
        else:
            binding(*args, torch_stream(like))
    else:
        binding(*args, None)


def host_list(values):
    """None, a number sequence, or a tensor/array (read to the host: the C++ API takes these
    per-head settings as host values, as the reference implementations read them)."""
    if values is None or isinstance(values, (list, tuple)):
        return values
    tolist = getattr(values, "tolist", None)
    if tolist is None:
        return values  # the binding names the argument and says what it expected
    return tolist()
