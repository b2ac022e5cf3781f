"""The model's definition of the compressed indexer keys (issue 17; docs/qsa.md, "Compressed
keys") as float64 torch statements, the oracle of the qsa_compress_block_keys tests."""

import math

import torch


def rope_tables(theta, positions, rope_dim, dtype=torch.float32):
    """transformers' cos/sin for rotate_half, [positions, rope_dim]: FP32 inverse
    frequencies, FP32 angles, then cat(freqs, freqs)."""
    j = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    inv_freq = (theta ** (-j / rope_dim)).float()
    angle = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([angle, angle], dim=-1).double()
    return emb.cos().to(dtype), emb.sin().to(dtype)


def ref_block_key(raw4, w, eps, cos_row, sin_row, rope_dim, style):
    """One compressed key from its 4 raw keys [4, D] (float64): mean, (1 + w) RMSNorm, RoPE
    with the position's cos/sin rows ([rope_dim // 2] per frequency or [rope_dim] per dim)."""
    m = raw4.double().mean(0)
    y = m / torch.sqrt((m * m).mean() + eps) * (1 + w.double())
    out = y.clone()
    half = rope_dim // 2
    for d in range(rope_dim):
        first = d % 2 == 0 if style == "interleaved" else d < half
        partner = (d + 1 if first else d - 1) if style == "interleaved" else \
            (d + half if first else d - half)
        j = d // 2 if style == "interleaved" else d % half
        col = d if cos_row.shape[0] == rope_dim else j
        c, s = float(cos_row[col]), float(sin_row[col])
        out[d] = y[d] * c - y[partner] * s if first else y[d] * c + y[partner] * s
    return out


def theta_row(theta, pos, rope_dim):
    """cos/sin rows [rope_dim // 2] at `pos` from theta, as transformers computes them."""
    j = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    inv_freq = (theta ** (-j / rope_dim)).float()
    angle = (torch.tensor(float(pos), dtype=torch.float32) * inv_freq).double()
    return angle.cos(), angle.sin()


def complete_blocks(start, rows):
    """The blocks b whose positions 4b .. 4b + 3 all lie in [max(start, 0), start + rows)."""
    first = max(0, -((-start) // 4))
    return range(first, max(first, (start + rows) // 4))


def ulp_tolerance(dtype, expected, both_rounded=False):
    """One rounding to the output dtype plus the FP32 computation's own error; with
    both_rounded (expected is itself a rounded FP32 result, e.g. the reference backend's), one
    output ulp: FP32 values a few ulps apart can round to neighbouring outputs."""
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    if both_rounded:
        ulp *= 2
    return 2e-5 + 1.01 * ulp * expected.abs()


def assert_keys_close(got, expected, dtype, both_rounded=False):
    """NaN (unwritten) positions equal, then within one output rounding (see ulp_tolerance)."""
    got, expected = got.double().cpu(), expected.double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(expected)), \
        "written slots differ from the complete blocks"
    ok = ~torch.isnan(expected)
    err = (got[ok] - expected[ok]).abs()
    tol = ulp_tolerance(dtype, expected[ok], both_rounded)
    if err.numel():
        worst = int((err - tol).argmax())
        assert bool((err <= tol).all()), \
            f"error {float(err[worst])} > {float(tol[worst])} (got {float(got[ok][worst])}, " \
            f"expected {float(expected[ok][worst])})"


def ref_compress(keys, w, *, eps=1e-6, cos=None, sin=None, rope_theta=None, rope_dim=64,
                 rope_style="rotate_half", cu_seqlens=None, start_positions=None,
                 block_table=None, page_size=None, out_shape):
    """The destination after a call on a NaN-filled out of out_shape (float64): NaN where no
    complete block goes. page_size, when given, is out_shape[1] (the call checks it)."""
    keys = keys.cpu()
    out = torch.full(out_shape, math.nan, dtype=torch.float64)
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        reqs = [keys[cu[r]:cu[r + 1]] for r in range(len(cu) - 1)]
    elif keys.dim() == 3:
        reqs = list(keys)
    else:
        reqs = [keys]
    starts = start_positions.tolist() if start_positions is not None else [0] * len(reqs)
    paged = block_table is not None
    for r, rows in enumerate(reqs):
        for b in complete_blocks(starts[r], rows.shape[0]):
            pos = 4 * b
            if cos is not None:
                c, s = cos[pos].double().cpu(), sin[pos].double().cpu()
            else:
                c, s = theta_row(rope_theta, pos, rope_dim)
            key = ref_block_key(rows[pos - starts[r]:pos - starts[r] + 4], w.cpu(), eps, c, s,
                                rope_dim, rope_style)
            if paged:
                ps = out_shape[1]
                if b // ps >= block_table.shape[1]:
                    continue
                page = int(block_table[r, b // ps])
                if page < 0 or page >= out_shape[0]:
                    continue
                out.view(out_shape[0], ps, -1)[page, b % ps] = key
            elif len(out_shape) == 2:
                if b < out_shape[0]:
                    out[b] = key
            elif b < out_shape[1]:
                out[r, b] = key
    return out
