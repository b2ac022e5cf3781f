"""Valid calls of every public function of sparse_attn, drawn with hypothesis, for
test_properties.py: each builder draws the shapes, layouts and options of one call, and
returns a Case holding the call's arguments, its oracle (the float64 torch statements of
qsa_testing.py / xattn_testing.py), and what each argument accepts, so that the
malformed-call properties know which changes must be rejected.

An argument's description is conservative: `pinned` lists only the axes whose size the rest
of the call fixes exactly, `Value.kind` / `Value.value` only values the documentation
(docs/qsa.md, docs/xattention.md, docs/python.md) rules out for this call."""

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from hypothesis import strategies as st

import sparse_attn
from qsa_testing import assert_close, expand_blocks, paged_kv_of, padded_kv_of, \
    ref_attention_rows, ref_merge, ref_mqa_decode, ref_mqa_prefill, ref_relu_scores, strided_copy
from compress_testing import assert_keys_close, ref_compress
from xattn_testing import cdiv, ref_block_sparse, ref_estimate_sums, ref_select

BF16, F16, F32, I32, U8, BOOL = (torch.bfloat16, torch.float16, torch.float32, torch.int32,
                                 torch.uint8, torch.bool)
I64 = torch.int64
META = (I32, I64)  # integer metadata (ids, offsets, lengths, positions): either width as stored
NAN, INF = math.nan, math.inf

# The existing suites' tolerances (test_qsa_indexer.py, test_qsa_attention.py, test_xattn.py).
SCORE_TOL = dict(rtol=2e-5, atol=2e-5)
OUT_TOL = {BF16: dict(rtol=1e-2, atol=1e-2), F16: dict(rtol=2e-3, atol=2e-3),
           F32: dict(rtol=1e-5, atol=1e-5)}
LSE_TOL = dict(rtol=1e-4, atol=1e-4)
SUMS_TOL = dict(rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# What an argument accepts
# --------------------------------------------------------------------------------------------

@dataclass
class Arg:
    """A tensor argument: accepted dtypes and ranks; `pinned` axes, whose size the rest of
    the call fixes; `out` for tensors the call writes; `make` builds a valid one for an
    optional argument the case left out; `row_axes` > 0 when the leading axes must collapse
    into one row axis (qsa_sparse_attention's zero-copy row view rule)."""
    dtypes: tuple
    ranks: tuple
    pinned: tuple = ()
    out: bool = False
    required: bool = True
    make: Optional[Callable[[], torch.Tensor]] = None
    row_axes: int = 0


@dataclass
class Value:
    """A non-tensor argument: `kind` holds values of a wrong type, `value` values of the right
    type that are out of range for this call. Each must be rejected."""
    kind: list = field(default_factory=list)
    value: list = field(default_factory=list)


class Case:
    """One valid call: fn(**kw), its oracle (check), what it wrote (for reruns), what each
    argument accepts (args: key "name" or "name[i]" for a tuple element -> Arg | Value),
    whole-call malformations (extras: description, kw -> malformed kw), whether the native
    backend must run it, and whether fn takes backend=. (A plain class: hypothesis prints
    failing examples with __repr__.)"""

    def __init__(self, fn, kw, args, check, written, extras=(), native=False, has_backend=True):
        self.fn, self.kw, self.args, self.check, self.written = fn, kw, args, check, written
        self.extras, self.native, self.has_backend = list(extras), native, has_backend

    def __repr__(self):
        return f"{self.fn.__name__}({describe_kw(self.kw)})"


def describe(value):
    """A short reproducible description of an argument (tensors: dtype, shape, strides)."""
    if isinstance(value, torch.Tensor):
        layout = "" if value.is_contiguous() else f", stride={tuple(value.stride())}"
        offset = f", offset={value.storage_offset()}" if value.storage_offset() else ""
        values = f" {value.tolist()}" if value.dtype == I32 and value.numel() <= 12 else ""
        return f"<{str(value.dtype)[6:]}{list(value.shape)}{layout}{offset} {value.device}>{values}"
    if isinstance(value, np.ndarray):
        return f"<numpy {value.dtype}{list(value.shape)} strides={value.strides}>"
    if isinstance(value, (tuple, list)) and any(isinstance(v, (torch.Tensor, np.ndarray))
                                                for v in value):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if callable(value):
        return "<callable>"
    return repr(value)


def describe_kw(kw):
    return ", ".join(f"{k}={describe(v)}" for k, v in kw.items())


def get_arg(kw, key):
    name, index = split_key(key)
    value = kw.get(name)
    return value if index is None or value is None else value[index]


def set_arg(kw, key, value, args=None):
    kw = dict(kw)
    name, index = split_key(key)
    if index is None:
        kw[name] = value
    else:
        items = kw.get(name)
        if items is None:  # a tuple argument the case left out: valid elements first
            items = [args[f"{name}[{i}]"].make() for i in range(2)]
        items = list(items)
        items[index] = value
        kw[name] = tuple(items)
    return kw


def widen_metadata(case, kw):
    """kw with every given int32 metadata input as int64 (the same values): the library reads
    either width as stored, so the call must give the same results."""
    for key, arg in case.args.items():
        value = get_arg(kw, key)
        if isinstance(arg, Arg) and not arg.out and I64 in arg.dtypes and \
                isinstance(value, torch.Tensor) and value.dtype == I32:
            kw = set_arg(kw, key, value.to(I64), case.args)
    return kw


def split_key(key):
    if key.endswith("]"):
        name, index = key[:-1].split("[")
        return name, int(index)
    return key, None


# --------------------------------------------------------------------------------------------
# Drawing tensors
# --------------------------------------------------------------------------------------------

class Rng:
    """torch random tensors from one drawn seed (hypothesis draws the seed and the shapes)."""

    def __init__(self, draw):
        self.g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def randn(self, shape, dtype, scale=1.0):
        return (torch.randn(shape, generator=self.g, dtype=torch.float64) * scale).to(dtype)

    def randint(self, lo, hi, shape):
        return torch.randint(lo, max(hi, lo + 1), shape, generator=self.g, dtype=I32)

    def rand(self, shape):
        return torch.rand(shape, generator=self.g, dtype=F32)

    def perm(self, n):
        return torch.randperm(n, generator=self.g).tolist()


POISON = {F32: NAN, BF16: NAN, F16: NAN, I32: -2**31 + 7, BOOL: True, U8: 0xA5}


def poisoned_view(shape, dtype, strided, keep_rows=0):
    """A writable view of `shape` filled with POISON inside a larger poisoned buffer (its
    `_base`), contiguous or offset and strided (every axis from keep_rows on padded, the last
    at stride 2), so that a test can check that nothing around the view was written."""
    shape = tuple(shape)
    if not strided or len(shape) == 0:
        return torch.full(shape, POISON[dtype], dtype=dtype)
    padded = [s if i < keep_rows else s + 1 for i, s in enumerate(shape)]
    padded[-1] = 2 * shape[-1] + 1
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * padded[d + 1]
    strides[-1] = 2
    base = torch.full((math.prod(padded) + 1,), POISON[dtype], dtype=dtype)
    return base.as_strided(shape, strides, 1)


def maybe_strided(draw, t, keep_rows=0):
    """t, or the same values in an offset, strided view (qsa_testing.strided_copy)."""
    if t.numel() < 2 or not draw(st.booleans()):
        return t
    return strided_copy(t, keep_rows=keep_rows)


def out_arg(draw, shape, dtype, keep_rows=0):
    """None (allocated by the call), or a poisoned view to pass as out=."""
    layout = draw(st.sampled_from(["none", "contiguous", "strided"]))
    if layout == "none":
        return None
    return poisoned_view(shape, dtype, layout == "strided", keep_rows)


def int32(values):
    return torch.tensor(values, dtype=I32)


def to_torch(x):
    """A host torch tensor of x's values (numpy arrays and CUDA tensors alike)."""
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x.cpu()


def check_out_identity(result, given):
    if given is not None:
        assert result is given, "out= given: the call must return that object"


# Scalar values every function must reject, by parameter type.
INT_KIND = [True, False, 1.5, "1"]
INT_HUGE = [2**63, -2**63 - 1, 2**64]
FLOAT_KIND = ["0.5", True, torch.tensor(0.5)]
# Positive scales: zero, negative, non-finite, and values whose FP32 rounding is inf or 0.
SCALE_VALUES = [0.0, -1.0, NAN, INF, -INF, 3.5e38, 1e-46]
FINITE_POSITIVE_VALUES = [0.0, -1.0, NAN, INF, -INF]
BOOL_KIND = [1, 0, "yes", None]
THRESHOLD_KIND = ["high", None, True]


# Malformed backends. 'native' is valid everywhere: on CPU tensors it is the CPU backend.
BACKEND = Value(kind=[3, None, b"reference"], value=["auto", "", "REFERENCE", "cuda"])


def threshold_values(heads):
    return [-0.1, 1.5, NAN, INF, [0.5] * (heads + 1), [NAN] * heads, [-0.5] * heads, [],
            ["x"] * heads]


def draw_threshold(draw, rng, heads):
    """A scalar threshold (exactly 0 and 1 included), one per head (list or tensor), or the
    thresholds as one list for the oracle."""
    kind = draw(st.sampled_from(["scalar", "edge", "list", "tensor"]))
    if kind == "scalar":
        t = draw(st.floats(0.0, 1.0))
        return t, [t] * heads
    if kind == "edge":
        t = draw(st.sampled_from([0.0, 1.0, 0, 1]))
        return t, [float(t)] * heads
    values = [draw(st.sampled_from([0.0, 0.3, 0.8, 0.95, 1.0])) for _ in range(heads)]
    return (values if kind == "list" else torch.tensor(values, dtype=torch.float64)), values


# --------------------------------------------------------------------------------------------
# QSA indexer: qsa_indexer_mqa_score
# --------------------------------------------------------------------------------------------

def score_rows(q_rows, keys, req, pos, active, scale):
    """q_rows [R, H, D]; keys [B, N, D] float64 (NaN rows: missing pages) -> [R, N] float64:
    scale * sum_h ReLU(q . k), -inf unless 4b + 3 <= position and the row is active."""
    R, N = q_rows.shape[0], keys.shape[1]
    out = torch.full((R, N), -INF, dtype=torch.float64)
    blocks = torch.arange(N)
    for r in range(R):
        if not active[r]:
            continue
        s = ref_relu_scores(q_rows[r:r + 1], keys[req[r]], scale)[0]
        s = s.masked_fill(~(4 * blocks + 3 <= pos[r]), -INF)
        out[r] = torch.where(torch.isnan(s), torch.full_like(s, -INF), s)
    return out


def draw_scale(draw, kw, multiplier="scale", denominator="score_scale", D=None):
    """Sets one of the two scale arguments (or neither); returns the multiplier in effect."""
    which = draw(st.sampled_from(["none", multiplier, denominator]))
    if which == multiplier:
        kw[multiplier] = draw(st.floats(0.01, 2.0))
        return kw[multiplier]
    if which == denominator and denominator is not None:
        kw[denominator] = draw(st.floats(0.5, 16.0))
        return 1.0 / kw[denominator]
    return 1.0 / math.sqrt(D)


def draw_indexer_geometry(draw):
    """(heads, dim): the native kernels' 4 x 128, or a small other one (reference only)."""
    if draw(st.booleans()):
        return 4, 128
    return draw(st.integers(1, 3)), draw(st.sampled_from([8, 16]))


def setting(**changes):
    """A whole-call malformation that sets the given arguments."""
    return lambda kw: {**kw, **changes}


def without(*names):
    """A whole-call malformation that leaves the given arguments out."""
    return lambda kw: {k: v for k, v in kw.items() if k not in names}


def scale_args(multiplier="scale", denominator="score_scale"):
    out = {multiplier: Value(kind=FLOAT_KIND, value=SCALE_VALUES)}
    if denominator:
        out[denominator] = Value(kind=FLOAT_KIND,
                                 value=[0.0, -1.0, NAN, INF, -INF, 1e-39, 1e46])
    return out


@st.composite
def indexer_score_case(draw, with_out=True):
    """with_out=False: no out= (the fused selection draws its own outputs)."""
    rng = Rng(draw)
    dt = draw(st.sampled_from([BF16, F16]))
    H, D = draw_indexer_geometry(draw)
    B = draw(st.integers(1, 3))
    paged = draw(st.booleans())
    layout = draw(st.sampled_from(["padded", "cu_seqlens_q", "token_to_req"]))
    kw, args, extras = {}, {}, []

    if paged:
        page_size, pages, max_pages = (draw(st.integers(1, 4)), draw(st.integers(1, 5)),
                                       draw(st.integers(1, 3)))
        cache = rng.randn((pages, page_size, D), dt)
        rank4 = draw(st.booleans())
        kw["block_keys"] = cache[:, :, None] if rank4 else cache
        table = rng.randint(-1, pages + 2, (B, max_pages))
        kw["block_table"] = maybe_strided(draw, table)
        if draw(st.booleans()):
            kw["page_size"] = page_size
        N = max_pages * page_size
        keys = torch.full((B, N, D), NAN, dtype=torch.float64)
        for b in range(B):
            for j in range(max_pages):
                if 0 <= int(table[b, j]) < pages:
                    keys[b, j * page_size:(j + 1) * page_size] = cache[int(table[b, j])].double()
    else:
        N = draw(st.integers(0, 10))
        block_keys = rng.randn((B, N, D), dt)
        kw["block_keys"] = maybe_strided(draw, block_keys)
        keys = block_keys.double()

    if layout == "padded":
        Q = draw(st.integers(0, 5))
        q = rng.randn((B, Q, H, D), dt)
        rows_shape = (B, Q)
        req = [b for b in range(B) for _ in range(Q)]
        local = [i for _ in range(B) for i in range(Q)]
        active = [True] * (B * Q)
        if draw(st.booleans()):
            lens = rng.randint(0, Q + 1, (B,))
            kw["seq_lens_q"] = lens
            active = [local[r] < int(lens[req[r]]) for r in range(B * Q)]
    else:
        lens = [draw(st.integers(0, 4)) for _ in range(B)]
        total = sum(lens)
        q = rng.randn((total, H, D), dt)
        rows_shape = (total,)
        if layout == "cu_seqlens_q":
            cu = [0] + np.cumsum(lens).tolist()
            kw["cu_seqlens_q"] = maybe_strided(draw, int32(cu))
            req = [b for b in range(B) for _ in range(lens[b])]
        else:
            req = [b for b in range(B) for _ in range(lens[b])]
            order = rng.perm(total) if draw(st.booleans()) else list(range(total))
            req = [req[i] for i in order]  # rows of different requests may interleave
            if draw(st.booleans()):  # padding rows of a graph-padded batch
                req = [-1 if rng.randint(0, 4, ()).item() == 0 else b for b in req]
            kw["token_to_req"] = int32(req) if total else torch.zeros(0, dtype=I32)
            if draw(st.booleans()):
                kw["num_requests"] = draw(st.integers(max(req, default=-1) + 1, B))
        local = [req[:r].count(req[r]) for r in range(total)]
        active = [b != -1 for b in req]
        req = [max(b, 0) for b in req]  # (a padding row's request is never read)
    kw["q_idx"] = maybe_strided(draw, q)
    positions = local
    # token_to_req rows are never counted (docs/qsa.md, "Metadata"): positions are required.
    if draw(st.booleans()) or layout == "token_to_req":
        pos = rng.randint(-3, 4 * N + 6, rows_shape)
        kw["query_positions"] = pos
        positions = pos.reshape(-1).tolist()
    scale = draw_scale(draw, kw, D=D)
    kw["backend"] = "reference"
    out_shape = (*rows_shape, N)
    kw["out"] = out_arg(draw, out_shape, F32) if with_out else None

    q_rows = q.reshape(-1, H, D)

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        result = to_torch(result)
        assert result.dtype == F32 and tuple(result.shape) == out_shape
        expected = score_rows(q_rows, keys, req, positions, active, scale)
        assert_close(result.reshape(q_rows.shape[0], N), expected, **SCORE_TOL)

    padded = layout == "padded"
    given_out = kw["out"] is not None
    rows_pinned = (0, 1) if padded and ("query_positions" in kw or given_out) else (0,)
    # The key batch is the request count: fixed by a padded q_idx or cu_seqlens_q; with
    # token_to_req any batch above the largest id is valid.
    batch_pin = (0,) if layout != "token_to_req" else ()
    args["q_idx"] = Arg((dt,), (3, 4), pinned=rows_pinned + (-1,))
    if paged:
        args["block_keys"] = Arg((dt,), (3, 4), pinned=(-1,) + (
            (1,) if "page_size" in kw or given_out else ()) + ((2,) if rank4 else ()))
        args["block_table"] = Arg(META, (2,), pinned=batch_pin + ((1,) if given_out else ()),
                                  required=False)
        args["page_size"] = Value(kind=INT_KIND, value=[page_size + 1, 0, -1] + INT_HUGE)
    else:
        args["block_keys"] = Arg((dt,), (3,),
                                 pinned=batch_pin + (-1,) + ((1,) if given_out else ()))
        extras.append(("page_size without block_table", setting(page_size=4)))
    if padded:
        args["seq_lens_q"] = Arg(META, (1,), pinned=(0,), required=False,
                                 make=lambda: torch.zeros(B, dtype=I32))
        extras += [
            ("cu_seqlens_q with padded q_idx", setting(cu_seqlens_q=int32([0] * (B + 1)))),
            ("token_to_req with padded q_idx",
             setting(token_to_req=torch.zeros(B * Q, dtype=I32))),
            ("num_requests with padded q_idx", setting(num_requests=B)),
            ("seq_lens_q above Q", setting(seq_lens_q=torch.full((B,), Q + 1, dtype=I32))),
            ("negative seq_lens_q", setting(seq_lens_q=torch.full((B,), -1, dtype=I32))),
        ]
    else:
        total = rows_shape[0]
        extras += [
            ("seq_lens_q with varlen q_idx", setting(seq_lens_q=torch.zeros(B, dtype=I32))),
            ("varlen q_idx without cu_seqlens_q or token_to_req",
             without("cu_seqlens_q", "token_to_req", "num_requests")),
        ]
        if layout == "cu_seqlens_q":
            args["cu_seqlens_q"] = Arg(META, (1,), pinned=(0,))
            extras += [
                ("cu_seqlens_q and token_to_req",
                 setting(token_to_req=torch.zeros(total, dtype=I32))),
                ("num_requests with cu_seqlens_q", setting(num_requests=B)),
                ("cu_seqlens_q not ending at total_q",
                 setting(cu_seqlens_q=int32([0] * B + [total + 1]))),
                ("cu_seqlens_q not starting at 0",
                 setting(cu_seqlens_q=int32([1] + [max(total, 1)] * B))),
            ]
            if B >= 2:
                extras.append(("decreasing cu_seqlens_q",
                               setting(cu_seqlens_q=int32([0, total + 1] + [total] * (B - 1)))))
        else:
            args["token_to_req"] = Arg(META, (1,), pinned=(0,))
            args["num_requests"] = Value(kind=INT_KIND, value=[-1, B + 1] + INT_HUGE)
            extras.append(("token_to_req without query_positions", without("query_positions")))
            if total:
                extras += [
                    ("token_to_req id >= num_requests",
                     setting(token_to_req=torch.full((total,), B, dtype=I32))),
                    ("token_to_req id below -1 (-1 marks a padding row)",
                     setting(token_to_req=torch.full((total,), -2, dtype=I32))),
                ]
                if any(active):
                    extras.append(("num_requests below a token_to_req id",
                                   setting(num_requests=max(req))))
    args["query_positions"] = Arg(META, (len(rows_shape),), pinned=tuple(range(len(rows_shape))),
                                  required=layout == "token_to_req",
                                  make=lambda: torch.zeros(rows_shape, dtype=I32))
    args["block_size"] = Value(kind=INT_KIND + [None], value=[3, 5, 0, -4, 2**63])
    args.update(scale_args())
    extras.append(("scale and score_scale", setting(scale=0.5, score_scale=2.0)))
    args["backend"] = BACKEND
    args["out"] = Arg((F32,), (len(out_shape),), pinned=tuple(range(len(out_shape))), out=True,
                      required=False, make=lambda: torch.empty(out_shape, dtype=F32))
    case = Case(sparse_attn.qsa_indexer_mqa_score, kw, args, check,
                written=lambda result, kw: [result], extras=extras,
                native=(H, D) == (4, 128))
    # What the fused selection's oracle needs: the rows, the width, each row's position and
    # whether it is a real row.
    case.rows = dict(shape=rows_shape, num_blocks=N, positions=positions, active=active)
    return case


# --------------------------------------------------------------------------------------------
# qsa_mqa_prefill / qsa_mqa
# --------------------------------------------------------------------------------------------

@st.composite
def mqa_prefill_case(draw, fn=sparse_attn.qsa_mqa_prefill):
    rng = Rng(draw)
    dt = draw(st.sampled_from([BF16, F16]))
    H, D = draw_indexer_geometry(draw)
    R, N = draw(st.integers(0, 8)), draw(st.integers(0, 12))
    q = rng.randn((R, H, D), dt)
    k_rank = draw(st.sampled_from([2, 3]))
    k = rng.randn((N, D) if k_rank == 2 else (N, 1, D), dt)
    starts = rng.randint(-2, N + 2, (R,))
    ends = starts + rng.randint(-1, N + 1, (R,))
    kw = dict(q=maybe_strided(draw, q), k=maybe_strided(draw, k),
              row_starts=maybe_strided(draw, starts), row_ends=maybe_strided(draw, ends))
    scale = draw_scale(draw, kw, D=D)
    kw["backend"] = "reference"
    kw["out"] = out_arg(draw, (R, N), F32)

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        assert to_torch(result).shape == (R, N)
        assert_close(to_torch(result), ref_mqa_prefill(q, k, starts, ends, scale), **SCORE_TOL)

    given_out = kw["out"] is not None
    args = {
        "q": Arg((dt,), (3,), pinned=(0, 2)),
        "k": Arg((dt,), (2, 3),
                 pinned=(-1,) + ((0,) if given_out else ()) + ((1,) if k_rank == 3 else ())),
        "row_starts": Arg(META, (1,), pinned=(0,)),
        "row_ends": Arg(META, (1,), pinned=(0,)),
        "backend": BACKEND,
        "out": Arg((F32,), (2,), pinned=(0, 1), out=True, required=False,
                   make=lambda: torch.empty((R, N), dtype=F32)),
        **scale_args(),
    }
    extras = [("scale and score_scale", setting(scale=0.5, score_scale=2.0))]
    return Case(fn, kw, args, check, written=lambda result, kw: [result], extras=extras,
                native=(H, D) == (4, 128))


# --------------------------------------------------------------------------------------------
# qsa_mqa_decode
# --------------------------------------------------------------------------------------------

@st.composite
def mqa_decode_case(draw, with_out=True):
    """with_out=False: no out= (the fused selection draws its own outputs)."""
    rng = Rng(draw)
    dt = draw(st.sampled_from([BF16, F16]))
    H, D = draw_indexer_geometry(draw)
    B = draw(st.integers(0, 4))
    page_size = draw(st.sampled_from([1, 3, 8, 12, 16]))
    pages, max_pages = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    # multi_row: multi-token decode, R query rows per request (native CUDA takes R <= 4).
    q_layout = draw(st.sampled_from(["rank3", "rank4", "broadcast", "multi_row"]))
    R = draw(st.integers(2, 5)) if q_layout == "multi_row" else 1
    if q_layout == "broadcast":
        q = rng.randn((1, H, D), dt).expand(B, H, D)  # stride 0 on the batch axis
    else:
        q = rng.randn({"rank3": (B, H, D), "rank4": (B, 1, H, D)}.get(q_layout, (B, R, H, D)),
                      dt)
        q = maybe_strided(draw, q)
    cache = rng.randn((pages, page_size, D), dt)
    cache_rank4 = draw(st.booleans())
    k_cache = cache[:, :, None] if cache_rank4 else maybe_strided(draw, cache)
    table = rng.randint(-1, pages + 2, (B, max_pages))
    # One count per query row; a single row's may also come as [B].
    per_row = R > 1 or draw(st.booleans())
    lens = rng.randint(-1, max_pages * page_size + 3, (B, R) if per_row else (B,))
    width = draw(st.integers(0, max_pages * page_size + 4))
    kw = dict(q=q, k_cache=k_cache, page_table=maybe_strided(draw, table),
              context_lens=maybe_strided(draw, lens), max_model_len=width)
    scale = draw_scale(draw, kw, D=D)
    kw["backend"] = "reference"
    kw["out"] = out_arg(draw, (B * R, width), F32) if with_out else None

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        assert to_torch(result).shape == (B * R, width)
        assert_close(to_torch(result), ref_mqa_decode(q, cache, table, lens, width, scale),
                     **SCORE_TOL)

    given_out = kw["out"] is not None
    q_rank = q.dim()
    args = {
        "q": Arg((dt,), (3, 4), pinned=(0, -1) + ((1,) if q_rank == 4 else ())),
        "k_cache": Arg((dt,), (3, 4), pinned=(-1,) + ((2,) if cache_rank4 else ())),
        "page_table": Arg(META, (2,), pinned=(0,)),
        "context_lens": Arg(META, (1, 2) if R == 1 else (2,), pinned=tuple(range(lens.dim()))),
        "max_model_len": Value(kind=INT_KIND + [None],
                               value=[-1, 2**63, -2**63] + ([width + 1] if given_out else [])
                               + ([2**62] if B else [])),
        "backend": BACKEND,
        "out": Arg((F32,), (2,), pinned=(0, 1), out=True, required=False,
                   make=lambda: torch.empty((B * R, width), dtype=F32)),
        **scale_args(),
    }
    extras = [("scale and score_scale", setting(scale=0.5, score_scale=2.0))]
    if R > 1:
        extras.append(("one context_len per request for R rows",
                       setting(context_lens=lens[:, 0].contiguous())))
    case = Case(sparse_attn.qsa_mqa_decode, kw, args, check, written=lambda result, kw: [result],
                extras=extras, native=(H, D) == (4, 128) and R <= 4)
    case.rows = dict(batch=B, rows=R, lens=lens, width=width)
    return case


# --------------------------------------------------------------------------------------------
# qsa_sparse_attention and its workspace size
# --------------------------------------------------------------------------------------------

def varlen_kv_of(key, value, cu_k, req):
    def kv(r):
        b = req[r]
        K, V = key[cu_k[b]:cu_k[b + 1]], value[cu_k[b]:cu_k[b + 1]]
        return K, V, [True] * K.shape[0]
    return kv


ATTENTION_OPTIONS = ("block_indices", "cu_seqlens_q", "token_to_req", "num_requests",
                     "cu_seqlens_k", "seq_lens_q", "seq_lens_k", "query_positions", "block_table",
                     "page_size", "gate")


@st.composite
def sparse_attention_case(draw, workspace_size=False):
    """qsa_sparse_attention (or, with workspace_size, qsa_sparse_attention_workspace_size on
    the same arguments): padded / flattened queries (cu_seqlens_q, token_to_req, neither) on
    padded, paged or flattened-varlen K/V, or physical selected_kv_indices; gates, LSE,
    GQA, the block hint, scale aliases, splits, workspaces."""
    rng = Rng(draw)
    dt = draw(st.sampled_from([BF16, F16]))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2, 3, 4]))
    D = draw(st.sampled_from([8, 16, 32, 256]))
    physical = draw(st.integers(0, 5)) == 0
    kw, args, extras = {}, {}, []
    if physical:
        dt = BF16
        R, total_kv, W = draw(st.integers(0, 5)), draw(st.integers(1, 16)), draw(st.integers(0, 8))
        query = rng.randn((R, hq, D), dt)
        key, value = rng.randn((total_kv, hkv, D), dt), rng.randn((total_kv, hkv, D), dt)
        sel = rng.randint(-3, total_kv + 3, (R, W))
        kw.update(query=maybe_strided(draw, query), key=maybe_strided(draw, key),
                  value=maybe_strided(draw, value), selected_kv_indices=maybe_strided(draw, sel))
        rows_shape = (R,)
        reference = dict(ids=sel, kv_of_row=lambda r: (key, value, [True] * total_kv),
                         positions=[0] * R, seq_lens_k=[total_kv] * R, active=[True] * R,
                         causal=False)
        kv_layout = q_layout = "physical"
        gate = None
    else:
        kv_layout = draw(st.sampled_from(["padded", "paged", "varlen"]))
        q_layout = draw(st.sampled_from(["padded", "cu_seqlens_q", "token_to_req", "single"]))
        B = 1 if q_layout == "single" else draw(st.integers(1, 3))
        if kv_layout == "padded":
            S = draw(st.integers(1, 12))
            key, value = rng.randn((B, S, hkv, D), dt), rng.randn((B, S, hkv, D), dt)
            capacity = [S] * B
        elif kv_layout == "paged":
            page_size, pages, max_pages = (draw(st.sampled_from([1, 2, 4, 8])),
                                           draw(st.integers(1, 6)), draw(st.integers(1, 3)))
            key = rng.randn((pages, page_size, hkv, D), dt)
            value = rng.randn((pages, page_size, hkv, D), dt)
            table = rng.randint(-1, pages + 1, (B, max_pages))
            kw["block_table"] = maybe_strided(draw, table)
            if draw(st.booleans()):
                kw["page_size"] = page_size
            capacity = [max_pages * page_size] * B
        else:
            lens_k = [draw(st.integers(0, 10)) for _ in range(B)]
            start = draw(st.integers(0, 2))
            cu_k = [start] + (start + np.cumsum(lens_k)).tolist()
            total_k = cu_k[-1] + draw(st.integers(0, 2))
            key, value = rng.randn((total_k, hkv, D), dt), rng.randn((total_k, hkv, D), dt)
            kw["cu_seqlens_k"] = maybe_strided(draw, int32(cu_k))
            capacity = lens_k
        # Query rows and the request each belongs to.
        if q_layout == "padded":
            Q = draw(st.integers(1, 4))
            rows_shape = (B, Q)
            req = [b for b in range(B) for _ in range(Q)]
            count = [Q] * B
        else:
            count = [draw(st.integers(0, 4)) for _ in range(B)]
            if q_layout == "single":
                count = [max(count[0], 1)]
            req = [b for b in range(B) for _ in range(count[b])]
            rows_shape = (len(req),)
            if q_layout == "cu_seqlens_q":
                kw["cu_seqlens_q"] = maybe_strided(draw, int32([0] + np.cumsum(count).tolist()))
            elif q_layout == "token_to_req":
                order = rng.perm(len(req)) if draw(st.booleans()) else list(range(len(req)))
                req = [req[i] for i in order]
                padding = [draw(st.booleans()) and rng.randint(0, 4, ()).item() == 0 for _ in req]
                ids = [-1 if pad else b for b, pad in zip(req, padding)]  # -1: a padding row
                kw["token_to_req"] = int32(ids) if req else torch.zeros(0, dtype=I32)
                if draw(st.booleans()):
                    kw["num_requests"] = B
        R = len(req)
        local = [req[:r].count(req[r]) for r in range(R)]
        query = rng.randn((*rows_shape, hq, D), dt)
        keep_rows = 2 if q_layout == "padded" else 0
        kw.update(query=maybe_strided(draw, query, keep_rows), key=maybe_strided(draw, key),
                  value=maybe_strided(draw, value))
        seq_len_k = list(capacity)
        if draw(st.booleans()):
            lens = [draw(st.integers(0, c)) for c in capacity]
            kw["seq_lens_k"] = maybe_strided(draw, int32(lens))
            seq_len_k = lens
        seq_len_q = list(count)
        active = [True] * R
        if q_layout == "token_to_req":
            active = [not pad for pad in padding]
        # token_to_req takes no seq_lens_q and needs positions (docs/qsa.md, "Metadata").
        if q_layout != "token_to_req" and draw(st.booleans()):
            lens = [draw(st.integers(0, c)) for c in count]
            kw["seq_lens_q"] = int32(lens)
            seq_len_q = lens
            active = [local[r] < lens[req[r]] for r in range(R)]
        positions = [seq_len_k[req[r]] - seq_len_q[req[r]] + local[r] for r in range(R)]
        hint = draw(st.booleans())
        if draw(st.booleans()) or hint or q_layout == "token_to_req":
            pos = rng.randint(-2, max(capacity) + 3, rows_shape)
            kw["query_positions"] = maybe_strided(draw, pos)  # any strides (no row-view rule)
            positions = pos.reshape(-1).tolist()
        if hint:
            nb = draw(st.integers(1, 3))
            blocks = torch.stack([rng.randint(-1, (max(p, 0) + 1) // 4 + 2, (nb,))
                                  for p in positions]) if R else torch.zeros((0, nb), dtype=I32)
            ids, kept = expand_blocks(blocks, positions)
            kw["token_indices"] = ids.reshape(*rows_shape, 4 * nb + 3)
            kw["block_indices"] = kept.reshape(*rows_shape, nb)
            kw["assume_compact_blocks"] = draw(st.booleans())
        else:
            W = draw(st.integers(0, 10))
            ids = rng.randint(-2, max(capacity) + 3, (*rows_shape, W))
            kw["token_indices"] = maybe_strided(draw, ids, keep_rows)
        gate = None
        gate_kind = draw(st.sampled_from(["none", "elementwise", "per_head"]))
        if gate_kind != "none":
            gate_shape = (*rows_shape, hq, D) if gate_kind == "elementwise" else (*rows_shape, hq)
            gate = rng.randn(gate_shape, dt, 2.0)
            kw["gate"] = maybe_strided(draw, gate, keep_rows)
        if kv_layout == "padded":
            kv_of_row = padded_kv_of(key, value, req)
        elif kv_layout == "paged":
            kv_of_row = paged_kv_of(key, value, table, req)
        else:
            kv_of_row = varlen_kv_of(key, value, cu_k, req)
        reference = dict(ids=kw["token_indices"].reshape(R, kw["token_indices"].shape[-1]),
                         kv_of_row=kv_of_row,
                         positions=positions, seq_lens_k=[seq_len_k[b] for b in req],
                         active=active, causal=True)
    which = draw(st.sampled_from(["none", "scale", "softmax_scale"]))  # aliases
    scale = 1 / math.sqrt(D)
    if which != "none":
        kw[which] = scale = draw(st.floats(0.01, 2.0))
    kw["num_splits"] = draw(st.sampled_from([None, 1, 2, 3]))
    kw["warp_specialized"] = draw(st.booleans())
    if draw(st.booleans()):
        kw["compute_dtype"] = draw(st.sampled_from([BF16, dt, "bfloat16"]))
    if draw(st.booleans()):
        kw["k_scale"], kw["v_scale"] = draw(st.sampled_from([(1.0, 1.0), (1, 1)]))
    kw["backend"] = "reference"
    keep_rows = 2 if q_layout == "padded" else 0
    out_shape, lse_shape = (*rows_shape, hq, D), (*rows_shape, hq)
    lse_mode = draw(st.sampled_from(["none", "return", "given", "both"]))
    if not workspace_size:
        kw["out"] = out_arg(draw, out_shape, dt, keep_rows)
        if lse_mode in ("return", "both"):
            kw["return_lse"] = True
        if lse_mode in ("given", "both"):
            kw["lse"] = poisoned_view(lse_shape, F32, draw(st.booleans()), keep_rows)
        workspace = draw(st.sampled_from(["none", "buffer", "callable"]))
        if workspace == "buffer":
            kw["workspace"] = torch.empty(64, dtype=U8)
        elif workspace == "callable":
            kw["workspace"] = lambda nbytes: torch.empty(nbytes, dtype=U8)
    return_lse = kw.get("return_lse", False)

    cache = {}

    def expected():
        if "value" not in cache:
            cache["value"] = ref_attention_rows(
                query.reshape(R, hq, D), reference["ids"], reference["kv_of_row"],
                reference["positions"], reference["seq_lens_k"], reference["active"], scale,
                gate=None if gate is None else gate.reshape(R, *gate.shape[len(rows_shape):]),
                out_dtype=dt, causal=reference["causal"])
        return cache["value"]

    def outputs(result, kw):
        out, lse = result if return_lse else (result, kw.get("lse"))
        return out, lse

    def check(result, kw):
        if workspace_size:
            assert type(result) is int and result >= 0, result
            if kw["backend"] == "reference" or not kw["query"].is_cuda:
                assert result == 0, result  # no scratch for the reference or host tensors
            else:  # a workspace of exactly that size serves the call
                workspace = torch.empty(result, dtype=U8, device=kw["query"].device)
                sparse_attn.qsa_sparse_attention(**kw, workspace=workspace)
            return
        out, lse = outputs(result, kw)
        check_out_identity(out, kw.get("out"))
        if return_lse:
            check_out_identity(lse, kw.get("lse"))
        assert out.shape == out_shape and out.dtype == dt
        ref_out, ref_lse = expected()
        assert_close(out.reshape(R, hq, D), ref_out, **OUT_TOL[dt])
        if lse is not None:
            assert lse.shape == lse_shape and lse.dtype == F32
            assert_close(lse.reshape(R, hq), ref_lse, **LSE_TOL)

    def written(result, kw):
        return [result] if workspace_size else [t for t in outputs(result, kw) if t is not None]

    # What each argument accepts.
    q_rank = len(rows_shape) + 2
    row_pins = tuple(range(len(rows_shape)))
    args["query"] = Arg((dt,), (3, 4), pinned=row_pins + (-1,), row_axes=keep_rows)
    args["key"] = Arg((dt,), (3, 4), pinned=tuple(range(key.dim())))
    args["value"] = Arg((dt,), (3, 4), pinned=tuple(range(value.dim())))
    args.update(scale_args("scale", None))
    args["softmax_scale"] = Value(kind=FLOAT_KIND, value=SCALE_VALUES)
    extras.append(("scale and softmax_scale", setting(scale=0.5, softmax_scale=0.5)))
    args["num_splits"] = Value(kind=INT_KIND, value=[0, -1, 2**31] + INT_HUGE)
    args["warp_specialized"] = Value(kind=BOOL_KIND)
    args["assume_compact_blocks"] = Value(kind=BOOL_KIND)
    args["k_scale"] = Value(kind=["1", None, True], value=[2.0, 0.5, 0.0, NAN, INF])
    args["v_scale"] = Value(kind=["1", None, True], value=[2.0, 0.5, 0.0, NAN, INF])
    args["compute_dtype"] = Value(kind=[3, None, 1.5], value=[
        F32, torch.float64, I32, torch.float8_e4m3fn, "int8", "float64", "float32"]
        + ([F16, "half"] if dt == BF16 else []))
    # Native runs on host tensors (the CPU backend, no scratch: size 0).
    args["backend"] = BACKEND
    if not workspace_size:
        args["return_lse"] = Value(kind=BOOL_KIND)
        args["out"] = Arg((dt,), (q_rank,), pinned=tuple(range(q_rank)), out=True, required=False,
                          make=lambda: torch.empty(out_shape, dtype=dt), row_axes=keep_rows)
        args["lse"] = Arg((F32,), (q_rank - 1,), pinned=tuple(range(q_rank - 1)), out=True,
                          required=False, make=lambda: torch.empty(lse_shape, dtype=F32),
                          row_axes=keep_rows)
        args["workspace"] = Arg((U8,), (1,), out=True, required=False,
                                make=lambda: torch.empty(64, dtype=U8))
        extras.append(("misaligned workspace",
                       setting(workspace=torch.empty(80, dtype=U8)[1:65])))
    if physical:
        args["selected_kv_indices"] = Arg(META, (2,), pinned=(0,))
        for name, make in (("seq_lens_k", lambda: torch.zeros(1, dtype=I32)),
                           ("query_positions", lambda: torch.zeros(R, dtype=I32)),
                           ("block_table", lambda: torch.zeros((1, 1), dtype=I32)),
                           ("cu_seqlens_q", lambda: int32([0, R])),
                           ("gate", lambda: torch.zeros((R, hq), dtype=dt)),
                           ("token_indices", lambda: torch.zeros((R, 1), dtype=I32))):
            extras.append((f"{name} with selected_kv_indices",
                           setting(**{name: make()})))
        extras.append(("selected_kv_indices with float16 tensors",
                       lambda kw: {**kw, **{n: kw[n].to(F16) for n in ("query", "key", "value")}}))
        return Case(sparse_attn.qsa_sparse_attention_workspace_size if workspace_size
                    else sparse_attn.qsa_sparse_attention, kw, args, check, written, extras,
                    native=False)

    rows = rows_shape[0] if len(rows_shape) == 1 else None
    args["token_indices"] = Arg(META, (2, 3), pinned=row_pins + ((-1,) if hint else ()),
                                row_axes=keep_rows)
    if hint:
        args["block_indices"] = Arg(META, (2, 3), pinned=row_pins + (-1,), required=False,
                                    row_axes=keep_rows)
    args["query_positions"] = Arg(META, (len(rows_shape),), pinned=row_pins,
                                  required=q_layout == "token_to_req",
                                  make=lambda: torch.zeros(rows_shape, dtype=I32))
    gate_rank = q_rank if gate is None else gate.dim()
    args["gate"] = Arg((dt,), (q_rank, q_rank - 1), pinned=tuple(range(gate_rank)),
                       required=False, make=lambda: torch.zeros(out_shape, dtype=dt),
                       row_axes=keep_rows)
    args["seq_lens_k"] = Arg(META, (1,), pinned=(0,), required=False,
                             make=lambda: int32(capacity))
    args["seq_lens_q"] = Arg(META, (1,), pinned=(0,), required=False, make=lambda: int32(count))
    extras += [
        ("no token_indices", setting(token_indices=None, block_indices=None)),
        ("token_indices and selected_kv_indices",
         setting(selected_kv_indices=torch.zeros((R, 1), dtype=I32))),
    ]
    # Broken metadata contents: the reference call reads and refuses them; the size function
    # reads no contents (docs/qsa.md, "Workspace").
    contents = [
        ("seq_lens_k above the capacity",
         setting(seq_lens_k=int32([c + 1 for c in capacity]))),
        ("negative seq_lens_k", setting(seq_lens_k=int32([-1] * B))),
        ("seq_lens_q above the rows of a request",
         setting(seq_lens_q=int32([c + 1 for c in count]))),
        ("negative seq_lens_q", setting(seq_lens_q=int32([-1] * B))),
    ]
    # Optional layout arguments: without them the call may be another valid layout (a
    # single request needs no row mapping; paged K/V without its table is padded K/V).
    if kv_layout == "paged":
        args["block_table"] = Arg(META, (2,), pinned=(0,), required=False)
        args["page_size"] = Value(kind=INT_KIND, value=[page_size + 1, 0, -1] + INT_HUGE)
        extras.append(("cu_seqlens_k with paged K/V",
                       setting(cu_seqlens_k=int32([0] * (B + 1)))))
    else:
        extras.append(("page_size without block_table",
                       setting(page_size=key.shape[1])))
    if kv_layout == "varlen":
        args["cu_seqlens_k"] = Arg(META, (1,), pinned=(0,), required=False)
        extras.append(("block_table with flattened K/V",
                       setting(block_table=torch.zeros((B, 1), dtype=I32))))
        contents += [
            ("cu_seqlens_k past the keys",
             setting(cu_seqlens_k=int32([0] * B + [key.shape[0] + 1]))),
            ("negative cu_seqlens_k start",
             setting(cu_seqlens_k=int32([-1] + [0] * B))),
        ]
        if B >= 2:
            contents.append(("decreasing cu_seqlens_k",
                             setting(cu_seqlens_k=int32([0, 2] + [1] * (B - 1)))))
    elif kv_layout == "padded":
        extras.append(("cu_seqlens_k with padded K/V",
                       setting(cu_seqlens_k=int32([0] * (B + 1)))))
    if q_layout == "padded":
        extras += [
            ("cu_seqlens_q with a padded query", setting(cu_seqlens_q=int32([0] * (B + 1)))),
            ("token_to_req with a padded query",
             setting(token_to_req=torch.zeros(R, dtype=I32))),
        ]
    else:
        extras.append(("num_requests other than the requests",
                       setting(num_requests=B + 1, token_to_req=int32(req))))
        if q_layout == "cu_seqlens_q":
            args["cu_seqlens_q"] = Arg(META, (1,), pinned=(0,), required=B > 1)
            extras.append(("cu_seqlens_q and token_to_req",
                           setting(token_to_req=torch.zeros(rows, dtype=I32))))
            contents.append(("cu_seqlens_q not ending at the rows",
                             setting(cu_seqlens_q=int32([0] * B + [rows + 1]))))
        elif q_layout == "token_to_req":
            args["token_to_req"] = Arg(META, (1,), pinned=(0,), required=B > 1)
            args["num_requests"] = Value(kind=INT_KIND, value=[B + 1, B - 1, -1] + INT_HUGE)
            extras += [("token_to_req without query_positions", without("query_positions")),
                       ("token_to_req with seq_lens_q", setting(seq_lens_q=int32(count)))]
            if rows:
                contents += [("token_to_req id >= B",
                              setting(token_to_req=torch.full((rows,), B, dtype=I32))),
                             ("token_to_req id below -1 (-1 marks a padding row)",
                              setting(token_to_req=torch.full((rows,), -2, dtype=I32)))]
        if B > 1:
            extras.append(("flattened query of several requests without a row mapping",
                           without("cu_seqlens_q", "token_to_req", "num_requests")))
    if not workspace_size:
        extras += contents
    native = (D == 256 and kv_layout == "paged" and hq // hkv <= 16)
    return Case(sparse_attn.qsa_sparse_attention_workspace_size if workspace_size
                else sparse_attn.qsa_sparse_attention, kw, args, check, written, extras,
                native=native)


# --------------------------------------------------------------------------------------------
# Selection helpers: qsa_topk_blocks, qsa_expand_blocks (CUDA tensors run natively; no backend)
# --------------------------------------------------------------------------------------------

def ref_topk(scores, k):
    flat = scores.reshape(math.prod(scores.shape[:-1]), scores.shape[-1]).double()
    out = torch.full((flat.shape[0], k), -1, dtype=I32)
    for r, row in enumerate(flat.tolist()):
        ids = [i for _, i in sorted((-v, i) for i, v in enumerate(row) if math.isfinite(v))][:k]
        out[r, :len(ids)] = int32(ids)
    return out.reshape(*scores.shape[:-1], k)


@st.composite
def topk_case(draw):
    rng = Rng(draw)
    lead = (draw(st.integers(0, 5)),) if draw(st.booleans()) else (draw(st.integers(1, 2)),
                                                                   draw(st.integers(0, 3)))
    N = draw(st.integers(0, 30))
    scores = rng.randint(0, 5, (*lead, N)).float()  # few distinct values: many ties
    special = rng.rand((*lead, N))
    scores[special < 0.2] = -INF
    scores[special > 0.93] = NAN
    scores[(special > 0.9) & (special <= 0.93)] = INF
    k = draw(st.integers(1, N + 3)) if draw(st.integers(0, 7)) else sparse_attn.QSA_TOPK_BLOCKS
    kw = dict(scores=maybe_strided(draw, scores))
    if k != sparse_attn.QSA_TOPK_BLOCKS or draw(st.booleans()):
        kw["k"] = k
    kw["out"] = out_arg(draw, (*lead, k), I32)

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        assert result.dtype == I32 and tuple(result.shape) == (*lead, k)
        assert torch.equal(result.cpu(), ref_topk(scores, k))

    given = kw["out"] is not None
    args = {
        "scores": Arg((F32,), (2, 3), pinned=tuple(range(len(lead))) if given else ()),
        # k = 2**62 is a valid request for zero rows (nothing to allocate).
        "k": Value(kind=INT_KIND + [None], value=[0, -1, -2**63, 2**63] + ([k + 1] if given else [])
                   + ([2**62] if math.prod(lead) else [])),
        "out": Arg((I32,), (len(lead) + 1,), pinned=tuple(range(len(lead) + 1)), out=True,
                   required=False, make=lambda: torch.empty((*lead, k), dtype=I32)),
    }
    return Case(sparse_attn.qsa_topk_blocks, kw, args, check, written=lambda r, kw: [r],
                native=True, has_backend=False)


@st.composite
def expand_case(draw):
    rng = Rng(draw)
    lead = (draw(st.integers(0, 5)),) if draw(st.booleans()) else (draw(st.integers(1, 2)),
                                                                   draw(st.integers(0, 3)))
    nb = draw(st.integers(1, 5))
    blocks = rng.randint(-2, 12, (*lead, nb))
    positions = rng.randint(-3, 50, lead)
    return_blocks = draw(st.booleans())
    kw = dict(block_ids=maybe_strided(draw, blocks), query_positions=maybe_strided(draw, positions))
    if return_blocks or draw(st.booleans()):
        kw["return_block_indices"] = return_blocks
    kw["token_indices"] = out_arg(draw, (*lead, 4 * nb + 3), I32)
    kw["block_indices"] = out_arg(draw, (*lead, nb), I32) if draw(st.booleans()) else None

    def outputs(result, kw):
        return result if return_blocks else (result, kw.get("block_indices"))

    def check(result, kw):
        tokens, kept = outputs(result, kw)
        check_out_identity(tokens, kw.get("token_indices"))
        if return_blocks:
            check_out_identity(kept, kw.get("block_indices"))
        ref_tokens, ref_kept = expand_blocks(blocks.reshape(-1, nb), positions.reshape(-1).tolist())
        assert tokens.dtype == I32 and tuple(tokens.shape) == (*lead, 4 * nb + 3)
        assert torch.equal(tokens.cpu().reshape(-1, 4 * nb + 3), ref_tokens)
        if kept is not None:
            assert torch.equal(kept.cpu().reshape(-1, nb), ref_kept)

    given = kw["token_indices"] is not None or kw["block_indices"] is not None
    rank = len(lead) + 1
    args = {
        "block_ids": Arg(META, (2, 3), pinned=tuple(range(len(lead))) + ((-1,) if given else ())),
        "query_positions": Arg(META, (len(lead),), pinned=tuple(range(len(lead)))),
        "return_block_indices": Value(kind=BOOL_KIND),
        "token_indices": Arg((I32,), (rank,), pinned=tuple(range(rank)), out=True, required=False,
                             make=lambda: torch.empty((*lead, 4 * nb + 3), dtype=I32)),
        "block_indices": Arg((I32,), (rank,), pinned=tuple(range(rank)), out=True, required=False,
                             make=lambda: torch.empty((*lead, nb), dtype=I32)),
    }
    return Case(sparse_attn.qsa_expand_blocks, kw, args, check,
                written=lambda r, kw: [t for t in outputs(r, kw) if t is not None],
                native=True, has_backend=False)


# --------------------------------------------------------------------------------------------
# Fused selections: qsa_indexer_select, qsa_mqa_decode_select and their workspace sizes. The
# oracle is their composition (docs/qsa.md, "Fused selection"): the score op's FP32 scores (the
# reference backend, itself checked against float64 above), ref_topk, expand_blocks at each
# row's position and the count of its entries >= 0; padding rows all -1 and count 0.
# --------------------------------------------------------------------------------------------

# The score case's malformations of metadata contents (which only a call reads).
INDEXER_CONTENT_EXTRAS = {
    "seq_lens_q above Q", "negative seq_lens_q", "cu_seqlens_q not ending at total_q",
    "cu_seqlens_q not starting at 0", "decreasing cu_seqlens_q", "token_to_req id >= num_requests",
    "token_to_req id below -1 (-1 marks a padding row)", "num_requests below a token_to_req id"}

SELECT_KEYS = ("topk", "out", "return_tokens", "token_indices", "valid_counts",
               "return_valid_counts", "max_workspace_bytes", "workspace", "query_positions")


def ref_selection(scores, k, row_pos):
    """(block ids [rows, k], token ids [rows, 4k + 3], counts [rows]) of FP32 scores [rows, N];
    row_pos[r] = -1 marks a padding row."""
    ids = ref_topk(to_torch(scores), k).reshape(-1, k)
    for r, p in enumerate(row_pos):
        if p < 0:
            ids[r] = -1
    tokens, _ = expand_blocks(ids, row_pos)
    return ids, tokens, (tokens >= 0).sum(-1).to(I32)


def draw_selection(draw, kw, args, rows_shape, num_blocks, expandable, workspace_size):
    """Draws the selection's arguments into kw / args: topk, the return flags, the outputs
    (none for the size functions), the budget and a workspace. expandable: token_indices and
    valid_counts may be asked for (decode: only with query_positions). Returns
    (k, wants tokens, wants counts)."""
    k = draw(st.sampled_from([1, 2, 5, num_blocks + 3])) if draw(st.integers(0, 5)) \
        else sparse_attn.QSA_TOPK_BLOCKS
    if k != sparse_attn.QSA_TOPK_BLOCKS or draw(st.booleans()):
        kw["topk"] = k
    rank = len(rows_shape)
    return_tokens = expandable and draw(st.booleans())
    return_counts = expandable and draw(st.booleans())
    for name, flag in (("return_tokens", return_tokens), ("return_valid_counts", return_counts)):
        if flag or draw(st.booleans()):
            kw[name] = flag
        args[name] = Value(kind=BOOL_KIND)
    given = False
    if not workspace_size:
        kw["out"] = out_arg(draw, (*rows_shape, k), I32)
        if expandable and draw(st.booleans()):
            kw["token_indices"] = out_arg(draw, (*rows_shape, 4 * k + 3), I32)
        if expandable and draw(st.booleans()):
            kw["valid_counts"] = out_arg(draw, rows_shape, I32)
        # (valid_counts does not depend on k.)
        given = any(kw.get(n) is not None for n in ("out", "token_indices"))
        args["out"] = Arg((I32,), (rank + 1,), pinned=tuple(range(rank + 1)), out=True,
                          required=False, make=lambda: torch.empty((*rows_shape, k), dtype=I32))
        args["token_indices"] = Arg((I32,), (rank + 1,), pinned=tuple(range(rank + 1)), out=True,
                                    required=False,
                                    make=lambda: torch.empty((*rows_shape, 4 * k + 3), dtype=I32))
        args["valid_counts"] = Arg((I32,), (rank,), pinned=tuple(range(rank)), out=True,
                                   required=False, make=lambda: torch.empty(rows_shape, dtype=I32))
        if draw(st.booleans()):
            kw["workspace"] = torch.empty(64, dtype=U8)
        args["workspace"] = Arg((U8,), (1,), out=True, required=False,
                                make=lambda: torch.empty(64, dtype=U8))
    budget = draw(st.sampled_from([None, 4 * num_blocks, 12 * num_blocks + 1]))
    if budget is not None:
        kw["max_workspace_bytes"] = budget
    args["topk"] = Value(kind=INT_KIND + [None],
                         value=[0, -1, -2**63, 2**63] + ([k + 1] if given else [])
                         + ([2**62] if math.prod(rows_shape) else []))
    args["max_workspace_bytes"] = Value(kind=INT_KIND, value=[-1, 2**64] + (
        [4 * num_blocks - 1] if num_blocks else []))
    wants_tokens = return_tokens or kw.get("token_indices") is not None
    wants_counts = return_counts or kw.get("valid_counts") is not None
    return k, wants_tokens, wants_counts


def selection_check(score_call, k, row_pos, rows_shape, workspace_size, first_arg):
    """The check and written functions of a fused selection case. score_call(kw) -> the score
    op's FP32 scores for the call's arguments."""
    def unpack(result, kw):
        if not (kw.get("return_tokens") or kw.get("return_valid_counts")):
            result = (result,)
        result = list(result)
        ids = result.pop(0)
        tokens = result.pop(0) if kw.get("return_tokens") else kw.get("token_indices")
        counts = result.pop(0) if kw.get("return_valid_counts") else kw.get("valid_counts")
        return ids, tokens, counts

    def check(result, kw):
        if workspace_size:
            assert type(result) is int and result >= 0, result
            if kw.get("backend") == "reference" or not kw[first_arg].is_cuda:
                assert result == 0, result
            return
        ids, tokens, counts = unpack(result, kw)
        check_out_identity(ids, kw.get("out"))
        if kw.get("return_tokens"):
            check_out_identity(tokens, kw.get("token_indices"))
        if kw.get("return_valid_counts"):
            check_out_identity(counts, kw.get("valid_counts"))
        want_ids, want_tokens, want_counts = ref_selection(score_call(kw), k, row_pos)
        assert ids.dtype == I32 and tuple(ids.shape) == (*rows_shape, k)
        assert torch.equal(to_torch(ids).reshape(-1, k), want_ids)
        if tokens is not None:
            assert tuple(tokens.shape) == (*rows_shape, 4 * k + 3)
            assert torch.equal(to_torch(tokens).reshape(-1, 4 * k + 3), want_tokens)
        if counts is not None:
            assert tuple(counts.shape) == tuple(rows_shape)
            assert torch.equal(to_torch(counts).reshape(-1), want_counts)

    def written(result, kw):
        return [result] if workspace_size else [t for t in unpack(result, kw) if t is not None]

    return check, written


@st.composite
def indexer_select_case(draw, workspace_size=False):
    """qsa_indexer_select (or its workspace size) on a drawn qsa_indexer_mqa_score call."""
    score = draw(indexer_score_case(with_out=False))
    info = score.rows
    rows_shape, N = info["shape"], info["num_blocks"]
    row_pos = [p if a and p >= 0 else -1 for p, a in zip(info["positions"], info["active"])]
    kw = {name: v for name, v in score.kw.items() if name != "out"}
    args = {name: a for name, a in score.args.items() if name != "out"}
    k, _, _ = draw_selection(draw, kw, args, rows_shape, N, True, workspace_size)
    # A given output fixes the query rows, as a given out= does for the score op.
    q = args["q_idx"]
    if any(kw.get(n) is not None for n in ("out", "token_indices", "valid_counts")) and \
            len(rows_shape) == 2 and 1 not in q.pinned:
        args["q_idx"] = Arg(q.dtypes, q.ranks, pinned=q.pinned + (1,))

    def scores(kw):
        score_kw = {name: v for name, v in kw.items() if name not in SELECT_KEYS}
        return sparse_attn.qsa_indexer_mqa_score(**{
            **score_kw, "query_positions": kw.get("query_positions"), "backend": "reference"})

    check, written = selection_check(scores, k, row_pos, rows_shape, workspace_size, "q_idx")
    extras = list(score.extras)
    if workspace_size:
        # The size function reads no metadata contents (as the score op's validation): broken
        # contents, and a total_q that only cu_seqlens_q's last value ties, are not its errors.
        extras = [(d, f) for d, f in extras if d not in INDEXER_CONTENT_EXTRAS]
        if "cu_seqlens_q" in kw:
            q = args["q_idx"]
            args["q_idx"] = Arg(q.dtypes, q.ranks, pinned=tuple(a for a in q.pinned if a != 0))
    else:
        extras.append(("misaligned workspace",
                       setting(workspace=torch.empty(80, dtype=U8)[1:65])))
    fn = sparse_attn.qsa_indexer_select_workspace_size if workspace_size \
        else sparse_attn.qsa_indexer_select
    return Case(fn, kw, args, check, written, extras, native=score.native and k <= 16384)


@st.composite
def decode_select_case(draw, workspace_size=False):
    """qsa_mqa_decode_select (or its workspace size) on a drawn qsa_mqa_decode call, with or
    without query_positions."""
    score = draw(mqa_decode_case(with_out=False))
    info = score.rows
    B, R, lens, width = info["batch"], info["rows"], info["lens"], info["width"]
    rows_shape = (B * R,)
    kw = {name: v for name, v in score.kw.items() if name != "out"}
    args = {name: a for name, a in score.args.items() if name != "out"}
    positions = None
    if draw(st.booleans()):
        positions = Rng(draw).randint(-3, 4 * width + 8, tuple(lens.shape))
        kw["query_positions"] = maybe_strided(draw, positions)
    k, wants_tokens, wants_counts = draw_selection(draw, kw, args, rows_shape, width,
                                                   positions is not None, workspace_size)
    flat_lens = lens.reshape(-1).tolist()
    flat_pos = positions.reshape(-1).tolist() if positions is not None else [0] * (B * R)
    row_pos = [p if n > 0 and p >= 0 else -1 for p, n in zip(flat_pos, flat_lens)]
    args["query_positions"] = Arg(META, (1, 2) if R == 1 else (2,),
                                  pinned=tuple(range(lens.dim())),
                                  required=wants_tokens or wants_counts,
                                  make=lambda: torch.zeros(tuple(lens.shape), dtype=I32))
    extras = list(score.extras)
    if positions is not None:
        extras.append(("query_positions of [B * R] rows",
                       setting(query_positions=torch.zeros(B * R + 1, dtype=I32))))

    def scores(kw):
        score_kw = {name: v for name, v in kw.items() if name not in SELECT_KEYS}
        return sparse_attn.qsa_mqa_decode(**{**score_kw, "backend": "reference"})

    check, written = selection_check(scores, k, row_pos, rows_shape, workspace_size, "q")
    if not workspace_size:
        extras.append(("misaligned workspace",
                       setting(workspace=torch.empty(80, dtype=U8)[1:65])))
        if positions is not None:
            extras.append(("token_indices without query_positions",
                           lambda kw: {**{n: v for n, v in kw.items() if n != "query_positions"},
                                       "return_tokens": True}))
    fn = sparse_attn.qsa_mqa_decode_select_workspace_size if workspace_size \
        else sparse_attn.qsa_mqa_decode_select
    return Case(fn, kw, args, check, written, extras, native=score.native and k <= 16384)


# --------------------------------------------------------------------------------------------
# merge_attention_states
# --------------------------------------------------------------------------------------------

@st.composite
def merge_case(draw):
    rng = Rng(draw)
    dt = draw(st.sampled_from([F32, BF16, F16]))
    n, rows, heads, dim = (draw(st.integers(1, 6)), draw(st.integers(0, 5)),
                           draw(st.integers(0, 3)), draw(st.integers(0, 20)))
    po = rng.randn((n, rows, heads, dim), dt)
    lse = rng.rand((n, rows, heads)) * 10 - 4
    special = rng.rand((n, rows, heads))
    po[special < 0.25] = NAN  # empty partials: never read
    lse[special < 0.25] = -INF
    lse[special > 0.97] = NAN
    lse[(special > 0.95) & (special <= 0.97)] = INF
    kw = dict(partial_out=maybe_strided(draw, po), partial_lse=maybe_strided(draw, lse))
    kw["out"] = out_arg(draw, (rows, heads, dim), draw(st.sampled_from([F32, BF16, F16])))
    return_lse = draw(st.booleans())
    if not return_lse or draw(st.booleans()):
        kw["return_lse"] = return_lse
    kw["lse_out"] = out_arg(draw, (rows, heads), F32) if draw(st.booleans()) else None
    kw["backend"] = "reference"

    def outputs(result, kw):
        return result if return_lse else (result, kw.get("lse_out"))

    def check(result, kw):
        out, merged_lse = outputs(result, kw)
        check_out_identity(out, kw.get("out"))
        if return_lse:
            check_out_identity(merged_lse, kw.get("lse_out"))
        out_dtype = dt if kw.get("out") is None else kw["out"].dtype
        assert out.dtype == out_dtype and tuple(out.shape) == (rows, heads, dim)
        ref_out, ref_lse = ref_merge(po, lse)
        assert_close(to_torch(out), ref_out, **OUT_TOL[out_dtype])
        if merged_lse is not None:
            assert_close(to_torch(merged_lse), ref_lse, **LSE_TOL)

    args = {
        "partial_out": Arg((F32, BF16, F16), (4,), pinned=(0, 1, 2) +
                           ((3,) if kw["out"] is not None else ())),
        "partial_lse": Arg((F32,), (3,), pinned=(0, 1, 2)),
        "out": Arg((F32, BF16, F16), (3,), pinned=(0, 1, 2), out=True, required=False,
                   make=lambda: torch.empty((rows, heads, dim), dtype=dt)),
        "lse_out": Arg((F32,), (2,), pinned=(0, 1), out=True, required=False,
                       make=lambda: torch.empty((rows, heads), dtype=F32)),
        "return_lse": Value(kind=BOOL_KIND),
        "backend": BACKEND,
    }
    return Case(sparse_attn.merge_attention_states, kw, args, check,
                written=lambda r, kw: [t for t in outputs(r, kw) if t is not None], native=True)


# --------------------------------------------------------------------------------------------
# qsa_compress_block_keys
# --------------------------------------------------------------------------------------------

@st.composite
def compress_case(draw):
    rng = Rng(draw)
    dt = draw(st.sampled_from([BF16, F16]))
    D = draw(st.sampled_from([128, 128, 16]))
    rope_dim = 64 if D == 128 else draw(st.sampled_from([0, 8, 16]))
    layout = draw(st.sampled_from(["single", "padded", "varlen"]))
    B = 1 if layout == "single" else draw(st.integers(0 if layout == "padded" else 1, 3))
    if layout == "varlen":
        lens = [draw(st.integers(0, 14)) for _ in range(B)]
        cu = int32([0] + np.cumsum(lens).tolist())
        keys = rng.randn((int(cu[-1]), D), dt)
    else:
        L = draw(st.integers(0, 14))
        keys = rng.randn((L, D) if layout == "single" else (B, L, D), dt)
    rows = keys.shape[-2]
    starts = rng.randint(-5, 9, (B,)) if draw(st.booleans()) else None
    paged = draw(st.booleans())
    w = rng.randn((D,), draw(st.sampled_from([BF16, F16, F32])), 0.3)
    kw = dict(keys=maybe_strided(draw, keys), weight=w)
    if draw(st.booleans()):
        kw["eps"] = draw(st.sampled_from([1e-5, 1e-6, 0.5]))
    max_pos = rows + 9
    if draw(st.booleans()):
        cols = draw(st.sampled_from([rope_dim // 2, rope_dim]))
        angle = rng.rand((max_pos, cols)).double() * 6.3
        kw["cos"], kw["sin"] = angle.cos().float(), angle.sin().float()
    else:
        kw["rope_theta"] = draw(st.sampled_from([1e4, 1e7, 2.5]))
    if D != 128 or draw(st.booleans()):
        kw["rope_dim"] = rope_dim
    style = draw(st.sampled_from(["rotate_half", "interleaved"]))
    if style != "rotate_half" or draw(st.booleans()):
        kw["rope_style"] = style
    if layout == "varlen":
        kw["cu_seqlens"] = maybe_strided(draw, cu)
    if starts is not None:
        kw["start_positions"] = maybe_strided(draw, starts)
    max_blocks = max_pos // 4 + 1
    page_size = None
    if paged:
        page_size = draw(st.sampled_from([1, 3, 5]))
        max_pages = draw(st.integers(1, -(-max_blocks // page_size)))
        pages = B * max_pages + draw(st.integers(0, 2))
        ids = rng.perm(pages)[:B * max_pages]
        table = int32(ids).reshape(B, max_pages) if B else torch.zeros((0, max_pages), dtype=I32)
        if table.numel() and draw(st.booleans()):
            table.view(-1)[0] = draw(st.sampled_from([-1, pages]))
        kw["block_table"] = maybe_strided(draw, table)
        if draw(st.booleans()):
            kw["page_size"] = page_size
        rank4 = draw(st.booleans())
        out_shape = (pages, page_size, 1, D) if rank4 else (pages, page_size, D)
    elif layout == "single":
        out_shape = (max_blocks if starts is not None else rows // 4, D)
    else:
        out_shape = (B, max_blocks if layout == "varlen" or starts is not None else rows // 4, D)
    needs_out = paged or layout == "varlen" or starts is not None
    kw["out"] = poisoned_view(out_shape, dt, draw(st.booleans())) if needs_out else \
        out_arg(draw, out_shape, dt)
    kw["backend"] = "reference"
    oracle_kw = {k: v for k, v in kw.items() if k not in ("keys", "weight", "out", "backend")}

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        assert result.dtype == dt and tuple(result.shape) == out_shape
        expected = ref_compress(keys, w, **oracle_kw, out_shape=out_shape)
        assert_keys_close(to_torch(result), expected, dt)

    given = kw["out"] is not None
    # Keys of the other rank are a single request (rank 2) or a batch of one (rank 3): valid
    # unless a contiguous out's rank or another argument's batch of B != 1 tells them apart.
    if layout == "varlen":
        keys_ranks = (2,)
    elif given and not paged:
        keys_ranks = (2,) if layout == "single" else (3,)
    elif layout == "padded" and B != 1 and (paged or starts is not None):
        keys_ranks = (3,)
    else:
        keys_ranks = (2, 3)
    fixes_batch = given and not paged and layout != "single"
    out_pinned = ((1 if kw.get("page_size") else None), (2 if out_shape[2:3] == (1,) else None),
                  -1) if paged else ((0, 2) if len(out_shape) == 3 else (1,))
    args = {
        "keys": Arg((dt,) if given else (BF16, F16), keys_ranks,
                    pinned=(-1,) + ((0,) if layout == "padded" and (fixes_batch or paged or
                                                                    starts is not None) else ())),
        "weight": Arg((BF16, F16, F32), (1,), pinned=(0,)),
        "eps": Value(kind=FLOAT_KIND + [None], value=[-1.0, NAN, INF, 1e39]),
        "rope_dim": Value(kind=INT_KIND + [None], value=[-2, rope_dim + 1, D + 2]),
        "rope_style": Value(kind=[3, None], value=["neox", "", "ROTATE_HALF"]),
        "backend": BACKEND,
        "out": Arg((dt,), (3, 4) if paged else (len(out_shape),),
                   pinned=tuple(a for a in out_pinned if a is not None) if paged else out_pinned,
                   out=True, required=needs_out, make=lambda: poisoned_view(out_shape, dt, False)),
    }
    if "cos" in kw:
        args["cos"] = Arg((F32,), (2,), pinned=(0, 1) if rope_dim else (1,))
        args["sin"] = Arg((F32,), (2,), pinned=(0, 1))
    else:
        args["rope_theta"] = Value(kind=FLOAT_KIND, value=[0.0, -1.0, NAN, INF])
    if layout == "varlen":
        args["cu_seqlens"] = Arg(META, (1,), pinned=(0,))
    if starts is not None:
        args["start_positions"] = Arg(META, (1,), pinned=(0,), required=False)
    if paged:
        # Without it a rank-3 out can read as a contiguous [B, N_B, D]: not always an error.
        args["block_table"] = Arg(META, (2,), pinned=(0,), required=False)
        args["page_size"] = Value(kind=INT_KIND, value=[page_size + 1])
    extras = [("cos and rope_theta", setting(rope_theta=1e4, cos=torch.ones(max_pos, rope_dim),
                                             sin=torch.ones(max_pos, rope_dim))),
              ("neither cos/sin nor rope_theta", without("cos", "sin", "rope_theta")),
              ("cos without sin", lambda kw: {**without("sin", "rope_theta")(kw),
                                              "cos": torch.ones(max_pos, rope_dim)})]
    if not paged:
        extras.append(("page_size without block_table", setting(page_size=1)))
    if layout == "padded":
        extras.append(("cu_seqlens with padded keys",
                       setting(cu_seqlens=torch.zeros(B + 1, dtype=I32))))
    return Case(sparse_attn.qsa_compress_block_keys, kw, args, check,
                written=lambda r, kw: [r], extras=extras, native=D == 128)


# --------------------------------------------------------------------------------------------
# XAttention: xattn_estimate, find_blocks_chunked
# --------------------------------------------------------------------------------------------

def bhld(draw, rng, shape, dt):
    """[B, H, L, D] values as a contiguous tensor, the transpose of a [B, L, H, D] one, or an
    offset strided view (the ops take any strides)."""
    t = rng.randn(shape, dt)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed":
        return t, t.transpose(1, 2).contiguous().transpose(1, 2)
    return t, (strided_copy(t) if layout == "strided" and t.numel() else t)


BOOL_FLAGS = ("causal", "keep_sink", "keep_recent")


@st.composite
def estimate_case(draw):
    rng = Rng(draw)
    dt = draw(st.sampled_from([BF16, F16, F32]))
    B, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    D = draw(st.sampled_from([4, 8, 16]))
    stride = draw(st.sampled_from([1, 2, 4, 8]))
    block_size = stride * draw(st.sampled_from([1, 2, 4])) if draw(st.integers(0, 4)) else 128
    causal, keep_sink, keep_recent = (draw(st.booleans()) for _ in range(3))
    Lk = draw(st.integers(1, 3 * block_size))
    Lq = draw(st.integers(1, Lk if causal or keep_recent else 3 * block_size))
    q, query = bhld(draw, rng, (B, hq, Lq, D), dt)
    k, key = bhld(draw, rng, (B, hkv, Lk, D), dt)
    threshold, thresholds = draw_threshold(draw, rng, hq)
    norm = draw(st.sampled_from([1, 1.0, 0.5, 2.0]))
    kw = dict(query_states=query, key_states=key, block_size=block_size, stride=stride, norm=norm,
              threshold=threshold, causal=causal, keep_sink=keep_sink, keep_recent=keep_recent,
              backend="reference")
    if draw(st.booleans()):
        kw["chunk_size"] = block_size * draw(st.integers(1, 3))
    kw["use_triton"] = draw(st.booleans())
    shape = (B, hq, cdiv(Lq, block_size), cdiv(Lk, block_size))
    if draw(st.booleans()):
        strided = draw(st.booleans())
        kw["out"] = (poisoned_view(shape, F32, strided), poisoned_view(shape, BOOL, strided))

    def check(result, kw):
        sums, masks = result
        if kw.get("out") is not None:
            assert sums is kw["out"][0] and masks is kw["out"][1]
        assert sums.dtype == F32 and masks.dtype == BOOL and sums.shape == masks.shape == shape
        assert_close(sums, ref_estimate_sums(q, k, block_size, stride, norm, causal), **SUMS_TOL)
        # The selection applied to the op's own sums: exact.
        assert torch.equal(masks.cpu(), ref_select(sums, thresholds, causal, keep_sink, keep_recent,
                                                   q_len=Lq, k_len=Lk, block_size=block_size))

    given = "out" in kw
    per_head = not isinstance(threshold, (int, float))
    args = {
        "query_states": Arg((dt,), (4,), pinned=(0, 3) + ((1,) if per_head or given else ())),
        "key_states": Arg((dt,), (4,), pinned=(0, 3)),
        "block_size": Value(kind=[True, float(block_size), str(block_size), None],
                            value=[0, -block_size, 2**63]
                            + ([block_size + 1] if stride > 1 else [])),
        "stride": Value(kind=[True, float(stride), str(stride), None],
                        value=[0, -1, 2 * block_size, 2**63]),
        "norm": Value(kind=["1", True, None], value=FINITE_POSITIVE_VALUES),
        "threshold": Value(kind=THRESHOLD_KIND, value=threshold_values(hq)),
        "chunk_size": Value(kind=[True, 1.5, "16384", None],
                            value=[0, -block_size, 2**63]
                            + ([block_size + 1] if block_size > 1 else [])),
        "select_mode": Value(kind=[3, None], value=["slash", "", "INVERSE"]),
        "softmax": Value(value=[False, 1, "yes"]),
        "kdb": Value(value=[2, 0, -1, 1.5]),
        "backend": BACKEND,
        "out": Value(kind=[torch.zeros(3), "x", 1.5],
                     value=[(torch.empty(shape, dtype=F32),),
                            (torch.empty(shape, dtype=F32), torch.empty(shape, dtype=BOOL), None)]),
        "out[0]": Arg((F32,), (4,), pinned=(0, 1, 2, 3), out=True, required=False,
                      make=lambda: torch.empty(shape, dtype=F32)),
        "out[1]": Arg((BOOL,), (4,), pinned=(0, 1, 2, 3), out=True, required=False,
                      make=lambda: torch.empty(shape, dtype=BOOL)),
        **{flag: Value(kind=BOOL_KIND) for flag in BOOL_FLAGS},
    }
    extras = []
    if (causal or keep_recent) and Lq >= 2:
        extras.append(("more query rows than keys with causal or keep_recent",
                       lambda kw: {**kw, "key_states": kw["key_states"][:, :, :Lq - 1]}))
    return Case(sparse_attn.xattn_estimate, kw, args, check,
                written=lambda r, kw: list(r), extras=extras)


@st.composite
def find_blocks_case(draw):
    rng = Rng(draw)
    B, H, qb = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    causal, keep_sink, keep_recent = (draw(st.booleans()) for _ in range(3))
    kb = draw(st.integers(qb, qb + 3)) if causal or keep_recent else draw(st.integers(1, 5))
    sums = rng.rand((B, H, qb, kb))
    sums[rng.rand((B, H, qb, kb)) < 0.2] = 0.0
    sums[0, 0, 0, :] = 0.25  # ties
    current_index = kb - qb
    if causal and draw(st.booleans()):
        current_index = draw(st.integers(0, kb - qb))
    threshold, thresholds = draw_threshold(draw, rng, H)
    kw = dict(input_tensor=maybe_strided(draw, sums), current_index=current_index,
              threshold=threshold, num_to_choose=None, decoding=False,
              mode=draw(st.sampled_from(["both", "prefill"])), causal=causal,
              keep_sink=keep_sink, keep_recent=keep_recent, backend="reference")
    if draw(st.booleans()):
        kw["block_size"] = draw(st.sampled_from([128, 64, 1]))
    kw["out"] = out_arg(draw, (B, H, qb, kb), BOOL)
    end = current_index + qb if causal else kb

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        assert result.dtype == BOOL and tuple(result.shape) == (B, H, qb, kb)
        expected = torch.zeros((B, H, qb, kb), dtype=BOOL)
        expected[..., :end] = ref_select(sums[..., :end], thresholds, causal, keep_sink,
                                         keep_recent)
        assert torch.equal(to_torch(result), expected)

    given = kw["out"] is not None
    per_head = not isinstance(threshold, (int, float))
    index_values = [-1, kb - qb + 1, 2**63, -2**63 - 1] if causal or keep_recent else []
    args = {
        "input_tensor": Arg((F32,), (4,), pinned=((1,) if per_head else ())
                            + ((0, 1, 2, 3) if given else ())),
        "current_index": Value(kind=[True, 1.0, "0", None], value=index_values),
        "threshold": Value(kind=THRESHOLD_KIND, value=threshold_values(H)),
        "num_to_choose": Value(value=[3, 0]),
        "decoding": Value(value=[True, 1]),
        "mode": Value(kind=[3, None], value=["decode", "", "BOTH"]),
        "block_size": Value(kind=[True, 128.0, "128", None], value=[0, -128, 2**63]),
        "backend": BACKEND,
        "out": Arg((BOOL,), (4,), pinned=(0, 1, 2, 3), out=True, required=False,
                   make=lambda: torch.empty((B, H, qb, kb), dtype=BOOL)),
        **{flag: Value(kind=BOOL_KIND) for flag in BOOL_FLAGS},
    }
    extras = []
    if causal and qb >= 2:
        extras.append(("more query blocks than key blocks with causal",
                       setting(input_tensor=sums[..., :qb - 1], out=None, current_index=-1)))
    if keep_recent and not causal and kb > qb:
        extras.append(("current_index other than k_blocks - q_blocks without causal",
                       setting(current_index=0)))
    return Case(sparse_attn.find_blocks_chunked, kw, args, check, written=lambda r, kw: [r],
                extras=extras)


# --------------------------------------------------------------------------------------------
# XAttention: block_sparse_attn_func, block_sparse_attn_paged_func, Xattention_prefill
# --------------------------------------------------------------------------------------------

def head_list(draw, values):
    """values as a list or an int32 tensor (upstream passes device tensors; both are read on
    the host)."""
    return list(values) if draw(st.booleans()) else torch.tensor(values, dtype=I32)


@st.composite
def block_sparse_case(draw, paged=False):
    rng = Rng(draw)
    dt = draw(st.sampled_from([BF16, F16, F32]))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 2))
    D = draw(st.sampled_from([8, 16, 32]))
    B = draw(st.integers(1, 2))
    lengths = st.sampled_from([0, 1, 5, 127, 128, 129, 200, 256, 257])
    lens_q = [draw(lengths) for _ in range(B)]
    lens_k = [draw(lengths) for _ in range(B)]
    is_causal = draw(st.booleans())
    types = [draw(st.sampled_from([1, 0, -1])) for _ in range(hq)] if draw(st.booleans()) \
        else [1] * hq
    kw = {}
    streaming = [draw(st.integers(0, 2)) for _ in range(2 * hq)] if -1 in types else None
    max_q = max(lens_q) + draw(st.integers(0, 3))
    max_k = max(lens_k) + draw(st.integers(0, 3))
    if paged:
        page_size = draw(st.sampled_from([16, 32, 64, 128, 256]))
        pages_of = [cdiv(n, page_size) for n in lens_k]
        max_pages = max(max(pages_of), 1) + draw(st.integers(0, 1))
        max_k = min(max_k, max_pages * page_size)  # the table holds at most that many keys
    sparse_heads = types.count(1)
    mask = rng.rand((B, sparse_heads, cdiv(max_q, 128), cdiv(max_k, 128))) < 0.6
    cu_q = [0] + np.cumsum(lens_q).tolist()
    cu_k = [0] + np.cumsum(lens_k).tolist()
    total_q = cu_q[-1] + draw(st.integers(0, 2))  # rows past the last sequence: not written
    total_k = cu_k[-1] + draw(st.integers(0, 2))
    q = rng.randn((total_q, hq, D), dt)
    k, v = rng.randn((total_k, hkv, D), dt), rng.randn((total_k, hkv, D), dt)
    softmax_scale = draw(st.sampled_from([None, 0.1, 0.7]))
    cu_q_t = maybe_strided(draw, int32(cu_q))
    mask_arg = mask if sparse_heads else None
    head_types = None if types == [1] * hq and draw(st.booleans()) else head_list(draw, types)
    streaming_arg = None if streaming is None else head_list(draw, streaming)
    out = out_arg(draw, (total_q, hq, D), dt)
    lse_layout = draw(st.sampled_from(["none", "contiguous", "transposed"]))
    lse = None if lse_layout == "none" else (
        poisoned_view((total_q, hq), F32, False) if lse_layout == "contiguous"
        else poisoned_view((hq, total_q), F32, False).t())
    if paged:
        num_pages = sum(pages_of) + draw(st.integers(0, 2))
        order = rng.perm(max(num_pages, 1))
        table = torch.full((B, max_pages), -1, dtype=I32)
        k_cache = rng.randn((max(num_pages, 1), page_size, hkv, D), dt)
        v_cache = rng.randn((max(num_pages, 1), page_size, hkv, D), dt)
        used = 0
        for b in range(B):
            for j in range(pages_of[b]):
                page = order[used]
                used += 1
                table[b, j] = page
                for t in range(j * page_size, min((j + 1) * page_size, lens_k[b])):
                    k_cache[page, t - j * page_size] = k[cu_k[b] + t]
                    v_cache[page, t - j * page_size] = v[cu_k[b] + t]
        kw.update(q=maybe_strided(draw, q), k_cache=maybe_strided(draw, k_cache),
                  v_cache=maybe_strided(draw, v_cache), block_table=maybe_strided(draw, table),
                  seqlens_k=maybe_strided(draw, int32(lens_k)), cu_seqlens_q=cu_q_t,
                  base_blockmask=mask_arg, max_seqlen_q=max_q, max_seqlen_k=max_k,
                  head_mask_type=head_types, streaming_info=streaming_arg,
                  softmax_scale=softmax_scale, is_causal=is_causal)
        fn = sparse_attn.block_sparse_attn_paged_func
    else:
        kw.update(q=maybe_strided(draw, q), k=maybe_strided(draw, k), v=maybe_strided(draw, v),
                  cu_seqlens_q=cu_q_t, cu_seqlens_k=maybe_strided(draw, int32(cu_k)),
                  head_mask_type=head_types, streaming_info=streaming_arg,
                  base_blockmask=mask_arg, max_seqlen_q_=max_q, max_seqlen_k_=max_k,
                  p_dropout=draw(st.sampled_from([0.0, 0])),
                  deterministic=draw(st.booleans()), softmax_scale=softmax_scale,
                  is_causal=is_causal)
        fn = sparse_attn.block_sparse_attn_func
    kw.update(backend="reference", out=out, lse=lse)
    n = cu_q[-1]
    scale = 1 / math.sqrt(D) if softmax_scale is None else softmax_scale

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        assert result.shape == (total_q, hq, D) and result.dtype == dt
        ref, ref_lse = ref_block_sparse(q, k, v, cu_q, cu_k, types, streaming, mask, scale,
                                        is_causal)
        assert_close(result[:n], ref[:n].to(dt), **OUT_TOL[dt])
        if kw.get("lse") is not None:
            assert_close(kw["lse"][:n], ref_lse[:n], **LSE_TOL)
        # Rows past the last sequence are not written.
        for t in (kw.get("out"), kw.get("lse")):
            if t is not None:
                assert torch.isnan(t[n:]).all(), "rows outside every sequence were written"

    def written(result, kw):
        return [result[:n]] + ([kw["lse"][:n]] if kw.get("lse") is not None else [])

    kv = ("k_cache", "v_cache") if paged else ("k", "v")
    max_names = ("max_seqlen_q", "max_seqlen_k") if paged else ("max_seqlen_q_", "max_seqlen_k_")
    given = out is not None or lse is not None
    args = {
        "q": Arg((dt,), (3,), pinned=(2,) + ((1,) if head_types is not None else ())
                 + ((0, 1) if given else ())),
        kv[0]: Arg((dt,), (4,) if paged else (3,), pinned=(1, 2, 3) if paged else (1, 2)),
        kv[1]: Arg((dt,), (4,) if paged else (3,), pinned=(1, 2, 3) if paged else (1, 2)),
        "cu_seqlens_q": Arg(META, (1,), pinned=(0,)),
        "head_mask_type": Value(kind=["1", [1.5] * hq],
                                value=[[2] * hq, [-2] * hq, [1] * (hq + 1)]),
        "softmax_scale": Value(kind=FLOAT_KIND, value=FINITE_POSITIVE_VALUES),
        "is_causal": Value(kind=BOOL_KIND),
        "backend": BACKEND,
        "out": Arg((dt,), (3,), pinned=(0, 1, 2), out=True, required=False,
                   make=lambda: torch.empty((total_q, hq, D), dtype=dt)),
        "lse": Arg((F32,), (2,), pinned=(0, 1), out=True, required=False,
                   make=lambda: torch.empty((total_q, hq), dtype=F32)),
    }
    for name, longest in zip(max_names, (max(lens_q), max(lens_k))):
        args[name] = Value(kind=[True, 1.5, "1", None],
                           value=[-1, 2**63, -2**63 - 1] + ([longest - 1] if longest else []))
    if streaming is not None:
        args["streaming_info"] = Value(kind=["x", [0.5] * (2 * hq)],
                                       value=[[-1] * (2 * hq), [0] * (2 * hq + 1)])
    if sparse_heads:
        args["base_blockmask"] = Arg((BOOL,), (4,), pinned=(0, 1, 2, 3))
        extras = [("no base_blockmask with block-sparse heads",
                   setting(base_blockmask=None))]
    else:
        extras = [("base_blockmask with no block-sparse head",
                   setting(base_blockmask=torch.zeros(mask.shape, dtype=BOOL)))]
    extras += [("cu_seqlens_q past the rows of q",
               setting(cu_seqlens_q=int32([0] * B + [total_q + 1])))]
    if B >= 2 and cu_q[-1] > 0:
        extras.append(("decreasing cu_seqlens_q",
                       setting(cu_seqlens_q=int32([0, cu_q[-1]] + [0] * (B - 1)))))
    if paged:
        args["block_table"] = Arg(META, (2,), pinned=(0,))
        args["seqlens_k"] = Arg(META, (1,), pinned=(0,))
        args["max_seqlen_k"].value.append(max_pages * page_size + 1)
        extras.append(("seqlens_k past max_seqlen_k",
                       setting(seqlens_k=int32([max_k + 1] * B))))
        extras.append(("negative seqlens_k", setting(seqlens_k=int32([-1] * B))))
        if lens_k[0]:
            def bad_page(kw):
                t = table.clone()
                t[0, 0] = k_cache.shape[0]
                return {**kw, "block_table": t}
            extras.append(("a used page id past the cache", bad_page))
    else:
        args["cu_seqlens_k"] = Arg(META, (1,), pinned=(0,))
        args["p_dropout"] = Value(kind=["0", None, True], value=[0.1, -0.1, NAN, 1.0])
        args["exact_streaming"] = Value(value=[True])
        args["return_attn_probs"] = Value(value=[True])
        extras.append(("cu_seqlens_k past the keys",
                       setting(cu_seqlens_k=int32([0] * B + [total_k + 1]))))
    return Case(fn, kw, args, check, written, extras)


def draw_prefill_geometry(draw):
    """(dtype, B, Hkv, Hq, D, stride, causal, keep_sink, keep_recent, Lk, Lq) of a valid
    prefill call of either form: Lq <= Lk where causal or keep_recent ask for it."""
    dt = draw(st.sampled_from([BF16, F16, F32]))
    B, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 2))
    D = draw(st.sampled_from([8, 16]))
    stride = draw(st.sampled_from([4, 8, 16]))
    causal, keep_sink, keep_recent = (draw(st.booleans()) for _ in range(3))
    lengths = st.sampled_from([1, 7, 128, 129, 200, 256, 300])
    Lk = draw(lengths)
    Lq = draw(lengths.filter(lambda n: n <= Lk) if causal or keep_recent else lengths)
    return dt, B, hkv, hq, D, stride, causal, keep_sink, keep_recent, Lk, Lq


def draw_prefill_options(draw, dt, q_shape, stride, threshold, flags):
    """The keyword arguments both prefill forms share, drawn: the estimate's and attention's
    options (chunk_size and softmax_scale sometimes left out), out= and sometimes lse=."""
    B, hq, Lq, D = q_shape
    causal, keep_sink, keep_recent = flags
    kw = dict(stride=stride, norm=draw(st.sampled_from([1, 0.5, 2.0])), threshold=threshold,
              causal=causal, keep_sink=keep_sink, keep_recent=keep_recent, backend="reference")
    if draw(st.booleans()):
        kw["chunk_size"] = 128 * draw(st.integers(1, 3))
    if draw(st.booleans()):
        kw["softmax_scale"] = draw(st.sampled_from([0.1, 0.5]))
    kw["out"] = out_arg(draw, q_shape, dt)
    if draw(st.booleans()):
        kw["lse"] = poisoned_view((B, hq, Lq), F32, draw(st.booleans()))
    return kw


def prefill_option_args(dt, q_shape, stride):
    """The Arg/Value specs Xattention_prefill and xattention_prefill_paged share: the estimate
    and attention options, and the out= / lse= outputs of a query of q_shape [B, Hq, Lq, D]."""
    B, hq, Lq, D = q_shape
    return {
        "stride": Value(kind=[True, float(stride), str(stride), None],
                        value=[0, -1, 3, 256, 2**63]),
        "norm": Value(kind=["1", True, None], value=FINITE_POSITIVE_VALUES),
        "threshold": Value(kind=THRESHOLD_KIND, value=threshold_values(hq)),
        "block_size": Value(kind=[True, 128.0, "128", None], value=[64, 0, -128, 256, 2**63]),
        "chunk_size": Value(kind=[True, 1.5, "x"], value=[0, -128, 100, 2**63]),
        "softmax_scale": Value(kind=FLOAT_KIND, value=FINITE_POSITIVE_VALUES),
        "backend": BACKEND,
        "out": Arg((dt,), (4,), pinned=(0, 1, 2, 3), out=True, required=False,
                   make=lambda: torch.empty((B, hq, Lq, D), dtype=dt)),
        "lse": Arg((F32,), (3,), pinned=(0, 1, 2), out=True, required=False,
                   make=lambda: torch.empty((B, hq, Lq), dtype=F32)),
        **{flag: Value(kind=BOOL_KIND) for flag in BOOL_FLAGS},
    }


@st.composite
def prefill_case(draw):
    rng = Rng(draw)
    dt, B, hkv, hq, D, stride, causal, keep_sink, keep_recent, Lk, Lq = draw_prefill_geometry(draw)
    q, query = bhld(draw, rng, (B, hq, Lq, D), dt)
    k, key = bhld(draw, rng, (B, hkv, Lk, D), dt)
    v, value = bhld(draw, rng, (B, hkv, Lk, D), dt)
    threshold, thresholds = draw_threshold(draw, rng, hq)
    kw = dict(query_states=query, key_states=key, value_states=value,
              **draw_prefill_options(draw, dt, (B, hq, Lq, D), stride, threshold,
                                     (causal, keep_sink, keep_recent)))
    scale = kw.get("softmax_scale", 1 / math.sqrt(D))

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        assert result.shape == (B, hq, Lq, D) and result.dtype == dt
        # The estimate's masks (checked against its own oracle elsewhere), then attention.
        _, masks = sparse_attn.xattn_estimate(
            q, k, 128, stride, norm=kw["norm"], threshold=threshold, causal=causal,
            keep_sink=keep_sink, keep_recent=keep_recent, backend="reference")
        for b in range(B):
            ref, ref_lse = ref_block_sparse(q[b].transpose(0, 1), k[b].transpose(0, 1),
                                            v[b].transpose(0, 1), [0, Lq], [0, Lk], [1] * hq,
                                            None, masks[b:b + 1], scale, causal)
            assert_close(result[b].transpose(0, 1), ref.to(dt), **OUT_TOL[dt])
            if kw.get("lse") is not None:
                assert_close(kw["lse"][b].transpose(0, 1), ref_lse, **LSE_TOL)

    def written(result, kw):
        return [result] + ([kw["lse"]] if kw.get("lse") is not None else [])

    per_head = not isinstance(threshold, (int, float))
    given = kw["out"] is not None or kw.get("lse") is not None
    args = {
        "query_states": Arg((dt,), (4,), pinned=(0, 3) + ((1,) if per_head else ())
                            + ((1, 2) if given else ())),
        "key_states": Arg((dt,), (4,), pinned=(0, 1, 2, 3)),
        "value_states": Arg((dt,), (4,), pinned=(0, 1, 2, 3)),
        "kdb": Value(value=[2, 0, -1, 1.5]),
        **prefill_option_args(dt, (B, hq, Lq, D), stride),
    }
    extras = []
    if (causal or keep_recent) and Lq >= 2:
        extras.append(("more query rows than keys with causal or keep_recent",
                       lambda kw: {**kw, "key_states": kw["key_states"][:, :, :Lq - 1],
                                   "value_states": kw["value_states"][:, :, :Lq - 1]}))
    return Case(sparse_attn.Xattention_prefill, kw, args, check, written, extras)


@st.composite
def prefill_paged_case(draw):
    """xattention_prefill_paged: a valid Xattention_prefill call whose keys and values live in
    a paged cache (shuffled page ids, spare slots of -1, any page size); its oracle is
    Xattention_prefill on the gathered keys (bitwise: the same computation)."""
    rng = Rng(draw)
    dt, B, hkv, hq, D, stride, causal, keep_sink, keep_recent, Lk, Lq = draw_prefill_geometry(draw)
    page_size = draw(st.sampled_from([1, 5, 64, 128, 300]))
    per_req = cdiv(Lk, page_size)
    num_pages = B * per_req + draw(st.integers(0, 2))
    order = rng.perm(num_pages)
    table = torch.full((B, per_req + draw(st.integers(0, 1))), -1, dtype=I32)
    for b in range(B):
        table[b, :per_req] = torch.as_tensor(order[b * per_req:(b + 1) * per_req])
    cache = rng.randn((num_pages, page_size, hkv, 2 * D), dt)
    k_cache, v_cache = cache[..., :D], cache[..., D:]
    _, query = bhld(draw, rng, (B, hq, Lq, D), dt)
    threshold, thresholds = draw_threshold(draw, rng, hq)
    kw = dict(query_states=query, k_cache=k_cache, v_cache=v_cache,
              block_table=maybe_strided(draw, table), k_len=Lk,
              **draw_prefill_options(draw, dt, (B, hq, Lq, D), stride, threshold,
                                     (causal, keep_sink, keep_recent)))

    def gathered(c):
        return torch.stack([c[table[b, :per_req].long()].reshape(-1, hkv, D)[:Lk]
                            for b in range(B)]).transpose(1, 2)

    def check(result, kw):
        check_out_identity(result, kw.get("out"))
        assert result.shape == (B, hq, Lq, D) and result.dtype == dt
        lse = None if kw.get("lse") is None else torch.empty((B, hq, Lq), dtype=F32)
        options = {name: kw[name] for name in ("stride", "norm", "threshold", "causal",
                                               "keep_sink", "keep_recent", "backend")}
        for name in ("chunk_size", "softmax_scale"):
            if name in kw:
                options[name] = kw[name]
        want = sparse_attn.Xattention_prefill(kw["query_states"], gathered(k_cache),
                                              gathered(v_cache), lse=lse, **options)
        assert torch.equal(result, want)
        if lse is not None:
            assert torch.equal(kw["lse"], lse)

    def written(result, kw):
        return [result] + ([kw["lse"]] if kw.get("lse") is not None else [])

    per_head = not isinstance(threshold, (int, float))
    given = kw["out"] is not None or kw.get("lse") is not None
    args = {
        "query_states": Arg((dt,), (4,), pinned=(0, 3) + ((1,) if per_head else ())
                            + ((1, 2) if given else ())),
        "k_cache": Arg((dt,), (4,), pinned=(1, 2, 3)),
        "v_cache": Arg((dt,), (4,), pinned=(0, 1, 2, 3)),
        "block_table": Arg(META, (2,), pinned=(0,)),
        "k_len": Value(kind=[1.5, str(Lk), None], value=[-1, 2**63, (per_req + 1) * page_size * 2]
                       + ([Lq - 1] if (causal or keep_recent) and Lq >= 1 else [])),
        **prefill_option_args(dt, (B, hq, Lq, D), stride),
    }

    def bad_page(kw):
        t = table.clone()
        t[0, 0] = num_pages
        return {**kw, "block_table": t}

    extras = [("a used page id past the cache", bad_page)]
    return Case(sparse_attn.xattention_prefill_paged, kw, args, check, written, extras)


# Every public function of the package and the builder of its valid calls.
BUILDERS = {
    "qsa_indexer_mqa_score": indexer_score_case,
    "qsa_mqa_prefill": mqa_prefill_case,
    "qsa_mqa": lambda: mqa_prefill_case(fn=sparse_attn.qsa_mqa),
    "qsa_mqa_decode": mqa_decode_case,
    "qsa_sparse_attention": sparse_attention_case,
    "qsa_sparse_attention_workspace_size": lambda: sparse_attention_case(workspace_size=True),
    "qsa_compress_block_keys": compress_case,
    "qsa_topk_blocks": topk_case,
    "qsa_expand_blocks": expand_case,
    "qsa_indexer_select": indexer_select_case,
    "qsa_indexer_select_workspace_size": lambda: indexer_select_case(workspace_size=True),
    "qsa_mqa_decode_select": decode_select_case,
    "qsa_mqa_decode_select_workspace_size": lambda: decode_select_case(workspace_size=True),
    "merge_attention_states": merge_case,
    "xattn_estimate": estimate_case,
    "find_blocks_chunked": find_blocks_case,
    "block_sparse_attn_func": block_sparse_case,
    "block_sparse_attn_paged_func": lambda: block_sparse_case(paged=True),
    "Xattention_prefill": prefill_case,
    "xattention_prefill_paged": prefill_paged_case,
}
