"""merge_attention_states (docs/merge.md): partial attention results over disjoint key sets
(SplitKV splits, the shards of a context-parallel group) combined into the result over their
union."""

from . import _C
from . import _runtime as rt


def _rank(x):
    shape = getattr(x, "shape", None)
    return -1 if shape is None else len(shape)


def merge_attention_states(partial_out, partial_lse, *, out=None, lse_out=None, return_lse=True,
                           backend="native"):
    """Merges N partial attention states per (row, head): partial_out [N, rows, heads, dim]
    (float32, bfloat16 or float16, any strides) and float32 partial_lse [N, rows, heads]
    (natural log, -inf for a partial that saw no key) give

        m = max_i lse_i, w_i = exp(lse_i - m)
        out = sum_i w_i out_i / sum_i w_i             [rows, heads, dim]
        lse = m + log(sum_i w_i)                       float32 [rows, heads]

    Rows whose partials are all -inf give out 0 and lse -inf; a partial with LSE -inf is never
    read (its out may be garbage); a NaN or +inf LSE makes the row's out and lse NaN. out has
    partial_out's dtype unless out= (float32, bfloat16 or float16) says otherwise; lse_out= is
    written whenever given. Returns (out, lse), or out alone with return_lse=False."""
    rt.require_bool(return_lse, "return_lse")
    want_lse = return_lse and lse_out is None
    if out is None or want_lse:
        shape = tuple(partial_out.shape[1:]) if _rank(partial_out) == 4 else \
            tuple(_C.merge_attention_states_shape(partial_out))
    try:
        if out is None:
            out = rt.empty(shape, partial_out, "partial_out")
        if want_lse:
            lse_out = rt.empty(shape[:2], partial_out, "partial_out", "float32")
    except rt.ALLOCATION_ERRORS as e:
        # The outputs still None are the ones that could not be allocated.
        out_missing = out is None
        lse_missing = want_lse and lse_out is None
        missing = (("out",) if out_missing else ()) + (("lse_out",) if lse_missing else ())
        rt.explain_allocation_failure(e, missing, lambda p: _C.merge_attention_states(
            partial_out, partial_lse, p if out_missing else out, p if lse_missing else lse_out,
            backend, None))
    rt.run(_C.merge_attention_states, "merge_attention_states", partial_out,
           (partial_out, partial_lse, out, lse_out, backend))
    return (out, lse_out) if return_lse else out
