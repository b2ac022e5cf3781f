"""QSA compressed indexer keys (docs/qsa.md, "Compressed keys"): the model's definition of the
keys the indexer scores, from the raw index keys of each token."""

from . import _C
from . import _runtime as rt


def _rank(x):
    shape = getattr(x, "shape", None)
    return -1 if shape is None else len(shape)


def qsa_compress_block_keys(keys, weight, *, eps=1e-6, cos=None, sin=None, rope_theta=None,
                            rope_dim=64, rope_style="rotate_half", cu_seqlens=None,
                            start_positions=None, block_table=None, page_size=None,
                            backend="tilelang", out=None):
    """Compressed keys of each complete 4-token block b: the FP32 mean of raw keys 4b..4b+3,
    RMS-normed with weight (1 + weight) and eps, RoPE at position 4b on the first rope_dim
    dims (rope_style "rotate_half", transformers' Qwen pairing, or "interleaved"), rounded
    once to the keys' dtype. keys: [T, D], [B, L, D] or [total, D] with cu_seqlens; RoPE from
    FP32 cos/sin tables [positions, rope_dim // 2 or rope_dim] or from rope_theta.
    start_positions: each request's position of its first key row (decode appends). The
    destination is out=: a paged cache [pages, page_size, (1,) D] with block_table, or
    [B, N_B, D] ([N_B, D] for keys [T, D]); only complete blocks are written, the rest of
    out keeps its values. Without out=, keys [T, D] / [B, L, D] without start_positions get
    a new [T // 4, D] / [B, L // 4, D] (which every block fills); other layouts need out=."""
    args = (eps, cos, sin, rope_theta, rope_dim, rope_style, cu_seqlens, start_positions,
            block_table, page_size, backend)
    if out is None:
        if block_table is not None or cu_seqlens is not None or start_positions is not None:
            # A destination only the caller knows. The binding checks every other argument
            # first (it raises naming out once they pass), so a malformed call names its fault.
            try:
                _C.qsa_compress_block_keys(keys, weight, _C.MISSING_OUTPUT, *args, None)
            except ValueError as e:
                if not str(e).startswith("out:"):
                    raise
            raise ValueError(
                "out: with block_table, cu_seqlens or start_positions the destination (a paged "
                "cache, or [B, N_B, D] of which a call fills only some blocks) is the caller's; "
                "pass out=")
        if _rank(keys) in (2, 3):
            shape = (*keys.shape[:-2], keys.shape[-2] // 4, keys.shape[-1])
        else:
            shape = _C.qsa_compress_block_keys_shape(keys)
        try:
            out = rt.empty(tuple(shape), keys, "keys")
        except rt.ALLOCATION_ERRORS as e:
            rt.explain_allocation_failure(e, ("out",), lambda p: _C.qsa_compress_block_keys(
                keys, weight, p, *args, None))
    rt.run(_C.qsa_compress_block_keys, "qsa_compress_block_keys", keys,
           (keys, weight, out, *args))
    return out
