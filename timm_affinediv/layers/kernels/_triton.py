""" The Triton kernels of the fused path, and their launchers

Every kernel walks a 4-D (N, C, H, W) tensor by its strides (NCHW and channels-last alike, strided views too) in
tiles of `BP` positions times `BC` channels, accumulates in float32, and reads its per-position maps (one channel
per group, `(N, G, H*W)` float32, contiguous) by the channel's group `c // CPG`. Rows of a matrix are the case
`H = W = 1`. Imported on first use, after `TRITON_INTERPRET` is read (Triton reads it when a kernel is defined).
"""
import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import triton
import triton.language as tl

from ...errors import KernelError
from ..patches import BoxFilter

ACTIVATIONS = {'none': 0, 'relu': 1, 'gelu': 2, 'silu': 3}
_TILE = 1024  # elements a program's tile holds: 8 a thread at _WARPS warps
_WARPS = 4
# a backward program's units, so that its partial sums have at most this many rows: few enough for the programs that
# sum them inside a later launch (`_sum_partials`, tiles of _SUM_ROWS x _SUM_COLUMNS), enough programs for a GPU
_PARTIAL_ROWS = 1024
_SUM_ROWS, _SUM_COLUMNS = 64, 32


@triton.jit
def _activation(z, ACT: tl.constexpr):
    if ACT == 1:
        z = tl.maximum(z, 0.)
    elif ACT == 2:
        z = 0.5 * z * (1. + tl.erf(z * 0.7071067811865476))
    elif ACT == 3:
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def _activation_grad(z, ACT: tl.constexpr):
    """d act(z) / dz."""
    if ACT == 1:
        d = tl.where(z > 0., 1., 0.)
    elif ACT == 2:
        d = 0.5 * (1. + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACT == 3:
        s = tl.sigmoid(z)
        d = s * (1. + z * (1. - s))
    else:
        d = tl.full(z.shape, 1., tl.float32)
    return d


@triton.jit
def _offsets(n, p, c, sn, sc, sh, sw, W, FLAT: tl.constexpr, I64: tl.constexpr):
    """ Element offsets `(BP, BC)` of positions `p` and channels `c` of sample `n`, in 32 bits unless `I64` (a tensor
    of 2^31 elements or more). `FLAT`: H and W are one dimension of stride `sw`."""
    if I64:
        n, p, c = n.to(tl.int64), p.to(tl.int64), c.to(tl.int64)
    if FLAT:
        pos = n * sn + p * sw
    else:
        pos = n * sn + (p // W) * sh + (p % W) * sw
    return pos[:, None] + c[None, :] * sc


@triton.jit
def _map_index(n, G, group, P, p, I64: tl.constexpr):
    """Offsets into an `(N, G, P)` contiguous map of `group` (a scalar or a `(1, BC)` row) at positions `p`."""
    if I64:
        n = n.to(tl.int64)
    return (n * G + group) * P + p


@triton.jit(do_not_specialize=['W', 'CPG', 'G', 'NPB'])
def _channel_sq_norm_kernel(
        x_ptr, sxn, sxc, sxh, sxw, q_ptr, C, P, W, CPG, G, NPB, alpha, beta,
        BP: tl.constexpr, BC: tl.constexpr, GROUPED: tl.constexpr, FLAT: tl.constexpr, I64: tl.constexpr):
    """`q[n, g, p] = alpha * sum_{c in group g} x[n, c, p]^2 + beta`."""
    pid = tl.program_id(0)
    n = pid // NPB
    p = (pid % NPB) * BP + tl.arange(0, BP)
    p_mask = p < P
    if GROUPED:
        g = tl.program_id(1)
        acc = tl.zeros([BP], tl.float32)
        for c0 in range(0, CPG, BC):
            local = c0 + tl.arange(0, BC)
            mask = p_mask[:, None] & (local < CPG)[None, :]
            offsets = _offsets(n, p, g * CPG + local, sxn, sxc, sxh, sxw, W, FLAT, I64)
            v = tl.load(x_ptr + offsets, mask=mask, other=0.).to(tl.float32)
            acc += tl.sum(v * v, axis=1)
        tl.store(q_ptr + _map_index(n, G, g, P, p, I64), acc * alpha + beta, mask=p_mask)
    else:
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        mask = p_mask[:, None] & (c < C)[None, :]
        v = tl.load(x_ptr + _offsets(n, p, c, sxn, sxc, sxh, sxw, W, FLAT, I64), mask=mask, other=0.).to(tl.float32)
        tl.store(q_ptr + _map_index(n, C, c[None, :], P, p[:, None], I64), v * v * alpha + beta, mask=mask)


@triton.jit
def _window_sum(map_ptr, n, group, oh, ow, smn, smg, smh, smw, MH, MW, SH, SW, PH, PW, DH, DW, mask,
                BP: tl.constexpr, BC: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, ADJOINT: tl.constexpr,
                SQUARE: tl.constexpr, I64: tl.constexpr):
    """ The box filter of an `(N, G, MH, MW)` map (strides `smn, smg, smh, smw`; `SQUARE`: of its squares) at
    positions `(oh, ow)` (`(BP, 1)` each) of the channels' groups `group` (`(1, BC)`): the sum over the window of a
    convolution (stride, padding, dilation) at each output position, or (`ADJOINT`) over the output positions whose
    windows hold each input position. Windows reaching into the padding read zeros."""
    if I64:
        n = n.to(tl.int64)
    base = n * smn + group * smg
    acc = tl.zeros([BP, BC], tl.float32)
    for kh in range(KH):
        for kw in range(KW):
            if ADJOINT:
                nh = oh + PH - kh * DH
                nw = ow + PW - kw * DW
                mh = nh // SH
                mw = nw // SW
                inside = (nh >= 0) & (nw >= 0) & (nh % SH == 0) & (nw % SW == 0) & (mh < MH) & (mw < MW)
            else:
                mh = oh * SH - PH + kh * DH
                mw = ow * SW - PW + kw * DW
                inside = (mh >= 0) & (mw >= 0) & (mh < MH) & (mw < MW)
            v = tl.load(map_ptr + (base + mh * smh + mw * smw), mask=mask & inside, other=0.).to(tl.float32)
            acc += v * v if SQUARE else v
    return acc


@triton.jit
def _sum_partials(part_ptr, sums_ptr, block, C, R, COLUMNS, BR: tl.constexpr, BCOL: tl.constexpr):
    """`sums[k, c] = sum_r part[k, r, c]` for `BCOL` of the `COLUMNS = K * C` columns `(k, c)` from `block * BCOL`,
    `part` a contiguous `(K, R, C)` float32 tensor (fewer than 2^31 elements), in a fixed order."""
    column = block * BCOL + tl.arange(0, BCOL)
    column_mask = column < COLUMNS
    first = (column // C) * R * C + column % C
    acc = tl.zeros([BR, BCOL], tl.float32)
    for r0 in range(0, R, BR):
        r = r0 + tl.arange(0, BR)
        mask = (r < R)[:, None] & column_mask[None, :]
        acc += tl.load(part_ptr + (first[None, :] + r[:, None] * C), mask=mask, other=0.)
    tl.store(sums_ptr + column, tl.sum(acc, axis=0), mask=column_mask)


@triton.jit(do_not_specialize=['W', 'NPB', 'MH', 'MW', 'PH', 'PW'])
def _box_filter_kernel(
        map_ptr, smn, smg, smh, smw, r_ptr, srn, src, srh, srw, C, P, W, NPB, MH, MW, SH, SW, PH, PW, DH, DW, scale,
        offset, BP: tl.constexpr, BC: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, ADJOINT: tl.constexpr,
        SQUARE: tl.constexpr, FLAT: tl.constexpr, I64: tl.constexpr):
    """ `r[n, c, p] = scale * sum + offset`, the box filter's sum (`_window_sum`; `SQUARE`: of the squares) of the
    map's channel `c` at each position `p` of `r`: one pass of a window split in two (rows, then columns), each
    channel its own."""
    pid = tl.program_id(0)
    n = pid // NPB
    p = (pid % NPB) * BP + tl.arange(0, BP)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (p < P)[:, None] & (c < C)[None, :]
    m = _window_sum(map_ptr, n, c[None, :], (p // W)[:, None], (p % W)[:, None], smn, smg, smh, smw, MH, MW, SH, SW,
                    PH, PW, DH, DW, mask, BP, BC, KH, KW, ADJOINT, SQUARE, I64)
    tl.store(r_ptr + _offsets(n, p, c, srn, src, srh, srw, W, FLAT, I64), m * scale + offset, mask=mask)


@triton.jit(do_not_specialize=['W', 'G', 'NPB', 'MH', 'MW', 'PH', 'PW', 'PC', 'R', 'COLUMNS', 'SUM_PROGRAMS'])
def _scale_kernel(
        y_ptr, syn, syc, syh, syw, b_ptr, bias_ptr, gain_ptr, pb_ptr, base_ptr, sbn, sbc, sbh, sbw,
        out_ptr, son, soc, soh, sow, m_out_ptr, C, P, W, CPG, G, NPB, alpha,
        smn, smg, smh, smw, MH, MW, SH, SW, PH, PW, DH, DW, box_scale, box_offset,
        part_ptr, sums_ptr, PC, R, COLUMNS, SUM_PROGRAMS,
        BP: tl.constexpr, BC: tl.constexpr, RSQRT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GAIN: tl.constexpr,
        HAS_PB: tl.constexpr, HAS_BASE: tl.constexpr, ACT: tl.constexpr, FLAT: tl.constexpr, SAME: tl.constexpr,
        I64: tl.constexpr, BOX: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, SQUARE: tl.constexpr,
        STORE_M: tl.constexpr, SUM: tl.constexpr, BR: tl.constexpr, BCOL: tl.constexpr, ONE_GROUP: tl.constexpr):
    """ `out = act(base + alpha * gain[c] * (y + bias[c]) * m'[n, c // CPG, p] + pb[c])`, `m' = rsqrt(m)` (`RSQRT`)
    or `m`; `SAME`: `base` and `out` have `y`'s strides (one tile of offsets serves the three).

    `m` is the contiguous map `b` at `y`'s positions (`BOX` 0), or the box filter with a `KH x KW` window
    (`_window_sum`) of the map `b` of strides `smn, smg, smh, smw` (`SQUARE`: of its squares, `b` being a depthwise
    convolution's input): `box_scale * sum + box_offset` over each output position's window (`BOX` 1, `b` at the
    convolution's input positions), or the adjoint's sum (`BOX` 2, `b` at its output positions). `STORE_M`: `m` is
    stored at `y`'s positions too, once per group, into the contiguous `(N, G, H, W)` `m_out`.

    `SUM`: the first `SUM_PROGRAMS` rows of programs sum partials of another kernel over their `R` rows instead
    (`_sum_partials`, `PC` channels), so the sum costs no launch of its own.

    `ONE_GROUP`: `m` has one channel (`G` 1), which every channel of the tile reads: its load or window sum and its
    rsqrt are computed once a position (a `(BP, 1)` column) instead of once an element.
    """
    pid = tl.program_id(0)
    if SUM:
        if pid < SUM_PROGRAMS:
            _sum_partials(part_ptr, sums_ptr, pid * tl.num_programs(1) + tl.program_id(1), PC, R, COLUMNS, BR, BCOL)
            return
        pid -= SUM_PROGRAMS
    n = pid // NPB
    p = (pid % NPB) * BP + tl.arange(0, BP)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (p < P)[:, None] & (c < C)[None, :]
    y_offsets = _offsets(n, p, c, syn, syc, syh, syw, W, FLAT, I64)
    if ONE_GROUP:
        # one map channel for every channel: its value (window sum, rsqrt) once a position, broadcast over the tile
        group = tl.zeros([1, 1], tl.int32)
        m_mask = (p < P)[:, None]
        first = m_mask & (tl.program_id(1) == 0)
        m_width: tl.constexpr = 1
    else:
        group = c[None, :] // CPG
        m_mask = mask
        first = mask & ((c % CPG) == 0)[None, :]
        m_width: tl.constexpr = BC
    if BOX == 0:
        m = tl.load(b_ptr + _map_index(n, G, group, P, p[:, None], I64), mask=m_mask, other=1.)
    else:
        m = _window_sum(b_ptr, n, group, (p // W)[:, None], (p % W)[:, None], smn, smg, smh, smw, MH, MW, SH, SW,
                        PH, PW, DH, DW, m_mask, BP, m_width, KH, KW, BOX == 2, SQUARE, I64)
        if BOX == 1:
            m = m * box_scale + box_offset
        m = tl.where(m_mask, m, 1.)
        if STORE_M:
            tl.store(m_out_ptr + _map_index(n, G, group, P, p[:, None], I64), m, mask=first)
    if RSQRT:
        m = tl.rsqrt(m)
    z = tl.load(y_ptr + y_offsets, mask=mask, other=0.).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + c, mask=c < C, other=0.).to(tl.float32)[None, :]
    z *= m * alpha
    if HAS_GAIN:
        z *= tl.load(gain_ptr + c, mask=c < C, other=0.).to(tl.float32)[None, :]
    if HAS_PB:
        z += tl.load(pb_ptr + c, mask=c < C, other=0.).to(tl.float32)[None, :]
    if HAS_BASE:
        base_offsets = y_offsets if SAME else _offsets(n, p, c, sbn, sbc, sbh, sbw, W, FLAT, I64)
        z += tl.load(base_ptr + base_offsets, mask=mask, other=0.).to(tl.float32)
    out_offsets = y_offsets if SAME else _offsets(n, p, c, son, soc, soh, sow, W, FLAT, I64)
    tl.store(out_ptr + out_offsets, _activation(z, ACT).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_backward_tile(g_ptr, sgn, sgc, sgh, sgw, y_ptr, syn, syc, syh, syw, gy_ptr, son, soc, soh, sow, bias_ptr,
                         gain_ptr, pb_ptr, n, p, c, c_mask, mask, r, W, HAS_BIAS: tl.constexpr,
                         HAS_GAIN: tl.constexpr, HAS_PB: tl.constexpr, ACT: tl.constexpr, FLAT: tl.constexpr,
                         SAME: tl.constexpr, I64: tl.constexpr):
    """ `(ga gain y, sums over the positions of ga, ga y r and dL/dy)` of the tile of positions `p` and channels `c`
    of sample `n`, `y` with its bias, `dL/dy = ga gain r` stored; `r` broadcasts over the tile.

    `ga = g act'(gain y r + pb)` is the gradient of the pre-activation: its sum is dL/dpb, its sum times `y r`
    dL/dgain, and the sum of dL/dy dL/dbias."""
    g_offsets = _offsets(n, p, c, sgn, sgc, sgh, sgw, W, FLAT, I64)
    y_offsets = g_offsets if SAME else _offsets(n, p, c, syn, syc, syh, syw, W, FLAT, I64)
    o_offsets = g_offsets if SAME else _offsets(n, p, c, son, soc, soh, sow, W, FLAT, I64)
    g = tl.load(g_ptr + g_offsets, mask=mask, other=0.).to(tl.float32)
    y = tl.load(y_ptr + y_offsets, mask=mask, other=0.).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + c, mask=c_mask, other=0.).to(tl.float32)[None, :]
    if HAS_GAIN:
        gain = tl.load(gain_ptr + c, mask=c_mask, other=0.).to(tl.float32)[None, :]
    if ACT != 0:
        z = y * r
        if HAS_GAIN:
            z *= gain
        if HAS_PB:
            z += tl.load(pb_ptr + c, mask=c_mask, other=0.).to(tl.float32)[None, :]
        g = g * _activation_grad(z, ACT)
    g_lin = g * gain if HAS_GAIN else g
    gy = g_lin * r
    tl.store(gy_ptr + o_offsets, gy.to(gy_ptr.dtype.element_ty), mask=mask)
    return g_lin * y, tl.sum(g, axis=0), tl.sum(g * y * r, axis=0), tl.sum(gy, axis=0)


@triton.jit
def _add_partial(ptr, index, c_mask, value, accumulate):
    tl.store(ptr + index, value + tl.load(ptr + index, mask=c_mask & accumulate, other=0.), mask=c_mask)


@triton.jit
def _store_partials(pbp_ptr, gp_ptr, bp_ptr, index, c_mask, sum_g, sum_gyr, sum_dy, accumulate,
                    WRITE_PB: tl.constexpr, WRITE_GAIN: tl.constexpr, WRITE_BIAS: tl.constexpr):
    """The program's sums over its positions of `g`, `gyr` and `dy`, those asked for, at `index` of each row, added
    to what is there where `accumulate`."""
    if WRITE_PB:
        _add_partial(pbp_ptr, index, c_mask, sum_g, accumulate)
    if WRITE_GAIN:
        _add_partial(gp_ptr, index, c_mask, sum_gyr, accumulate)
    if WRITE_BIAS:
        _add_partial(bp_ptr, index, c_mask, sum_dy, accumulate)


@triton.jit
def _unit_positions(pid, s, S, UNITS, NPB, P, BP: tl.constexpr):
    """`(n, p, p_mask)`: the sample and positions of the program's `s`-th unit, a block of `BP` positions of one
    sample; the program walks units `pid * S` to `pid * S + S - 1` of the `UNITS = N * NPB`."""
    unit = pid * S + s
    n = unit // NPB
    p = (unit % NPB) * BP + tl.arange(0, BP)
    return n, p, (p < P) & (unit < UNITS)


@triton.jit(do_not_specialize=['W', 'CPG', 'G', 'NPB', 'UNITS', 'S'])
def _scale_backward_kernel(
        g_ptr, sgn, sgc, sgh, sgw, y_ptr, syn, syc, syh, syw, b_ptr, bias_ptr, gain_ptr, pb_ptr,
        gy_ptr, son, soc, soh, sow, t_ptr, pbp_ptr, gp_ptr, bp_ptr, C, P, W, CPG, G, NPB, UNITS, S,
        BP: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GAIN: tl.constexpr, HAS_PB: tl.constexpr,
        ACT: tl.constexpr, WRITE_PB: tl.constexpr, WRITE_GAIN: tl.constexpr, WRITE_BIAS: tl.constexpr,
        GROUPED: tl.constexpr, UNITS_OUTER: tl.constexpr, FLAT: tl.constexpr, SAME: tl.constexpr,
        I64: tl.constexpr):
    """ The output pass's backward, `out = act(gain (y + bias) r + pb)`, `r = rsqrt(b)`, given `g = dL/dout`
    (`y` below with its bias):

        ga = g act'(gain y r + pb),   dL/dy = ga gain r,   t[n, group, p] = r^3 sum_{c in group} ga gain y,
        pbp, gp, bp[program, c] = sums over the program's positions of ga, ga y r and dL/dy
                                  (summed over programs: dL/dpb, dL/dgain and dL/dbias)

    A program walks `S` units of `BP` positions (`_unit_positions`), so the partial sums have one row a program.
    Where a group has several blocks of channels, one of the two sums is carried in memory across them: `t` over the
    blocks of channels (the blocks outer), or (`UNITS_OUTER`, for tiles of many positions and few channels) the
    partial sums over the units; a barrier separates the rounds, as other threads of the program read them.
    `SAME`: `y` and `dL/dy` have `g`'s strides, and one tile of offsets serves the three.
    """
    pid = tl.program_id(0)
    if GROUPED and UNITS_OUTER:
        grp = tl.program_id(1)
        for s in range(S):
            n, p, p_mask = _unit_positions(pid, s, S, UNITS, NPB, P, BP)
            map_index = _map_index(n, G, grp, P, p, I64)
            r = tl.rsqrt(tl.load(b_ptr + map_index, mask=p_mask, other=1.))
            acc = tl.zeros([BP], tl.float32)
            for c0 in range(0, CPG, BC):
                local = c0 + tl.arange(0, BC)
                c = grp * CPG + local
                c_mask = local < CPG
                gy, tile_g, tile_gyr, tile_dy = _scale_backward_tile(
                    g_ptr, sgn, sgc, sgh, sgw, y_ptr, syn, syc, syh, syw, gy_ptr, son, soc, soh, sow, bias_ptr,
                    gain_ptr, pb_ptr, n, p, c, c_mask, p_mask[:, None] & c_mask[None, :], r[:, None], W, HAS_BIAS,
                    HAS_GAIN, HAS_PB, ACT, FLAT, SAME, I64)
                acc += tl.sum(gy, axis=1)
                _store_partials(pbp_ptr, gp_ptr, bp_ptr, pid * C + c, c_mask, tile_g, tile_gyr, tile_dy, s > 0,
                                WRITE_PB, WRITE_GAIN, WRITE_BIAS)
            tl.store(t_ptr + map_index, acc * r * r * r, mask=p_mask)
            tl.debug_barrier()
    elif GROUPED:
        grp = tl.program_id(1)
        for c0 in range(0, CPG, BC):
            local = c0 + tl.arange(0, BC)
            c = grp * CPG + local
            c_mask = local < CPG
            sum_g = tl.zeros([BC], tl.float32)
            sum_gyr = tl.zeros([BC], tl.float32)
            sum_dy = tl.zeros([BC], tl.float32)
            for s in range(S):
                n, p, p_mask = _unit_positions(pid, s, S, UNITS, NPB, P, BP)
                map_index = _map_index(n, G, grp, P, p, I64)
                r = tl.rsqrt(tl.load(b_ptr + map_index, mask=p_mask, other=1.))
                gy, tile_g, tile_gyr, tile_dy = _scale_backward_tile(
                    g_ptr, sgn, sgc, sgh, sgw, y_ptr, syn, syc, syh, syw, gy_ptr, son, soc, soh, sow, bias_ptr,
                    gain_ptr, pb_ptr, n, p, c, c_mask, p_mask[:, None] & c_mask[None, :], r[:, None], W, HAS_BIAS,
                    HAS_GAIN, HAS_PB, ACT, FLAT, SAME, I64)
                # `t` carried over the blocks of channels, scaled by r^3 after the last
                acc = tl.sum(gy, axis=1) + tl.load(t_ptr + map_index, mask=p_mask & (c0 > 0), other=0.)
                tl.store(t_ptr + map_index, tl.where(c0 + BC >= CPG, acc * r * r * r, acc), mask=p_mask)
                sum_g += tile_g
                sum_gyr += tile_gyr
                sum_dy += tile_dy
            _store_partials(pbp_ptr, gp_ptr, bp_ptr, pid * C + c, c_mask, sum_g, sum_gyr, sum_dy, False, WRITE_PB,
                            WRITE_GAIN, WRITE_BIAS)
            tl.debug_barrier()
    else:
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        c_mask = c < C
        sum_g = tl.zeros([BC], tl.float32)
        sum_gyr = tl.zeros([BC], tl.float32)
        sum_dy = tl.zeros([BC], tl.float32)
        for s in range(S):
            n, p, p_mask = _unit_positions(pid, s, S, UNITS, NPB, P, BP)
            mask = p_mask[:, None] & c_mask[None, :]
            map_index = _map_index(n, C, c[None, :], P, p[:, None], I64)
            r = tl.rsqrt(tl.load(b_ptr + map_index, mask=mask, other=1.))
            gy, tile_g, tile_gyr, tile_dy = _scale_backward_tile(
                g_ptr, sgn, sgc, sgh, sgw, y_ptr, syn, syc, syh, syw, gy_ptr, son, soc, soh, sow, bias_ptr, gain_ptr,
                pb_ptr, n, p, c, c_mask, mask, r, W, HAS_BIAS, HAS_GAIN, HAS_PB, ACT, FLAT, SAME, I64)
            tl.store(t_ptr + map_index, gy * r * r * r, mask=mask)
            sum_g += tile_g
            sum_gyr += tile_gyr
            sum_dy += tile_dy
        _store_partials(pbp_ptr, gp_ptr, bp_ptr, pid * C + c, c_mask, sum_g, sum_gyr, sum_dy, False, WRITE_PB,
                        WRITE_GAIN, WRITE_BIAS)


#: where launches go instead of a GPU while `launches_recorded` holds: `record(kernel, args, constexprs)`
_recorder: Optional[Callable[[Any, tuple, dict], None]] = None


@contextlib.contextmanager
def launches_recorded(record: Callable[[Any, tuple, dict], None]) -> Iterator[None]:
    """ Every launch given to `record(kernel, args, constexprs)` instead of run, so that a CPU can see what a step
    launches (scripts/launch_count.py, kernel_registers.py, gpu_model.py, through `recording.recorded_launches`)."""
    global _recorder
    saved, _recorder = _recorder, record
    try:
        yield
    finally:
        _recorder = saved


def _launch(kernel, grid, *args, **constexprs) -> None:
    """`kernel[grid](*args, **constexprs)`; a failure to build or launch it is raised as a `KernelError` naming it."""
    if _recorder is not None:
        _recorder(kernel, args, constexprs)
        return
    try:
        kernel[grid](*args, **constexprs)
    except Exception as error:
        raise KernelError(f'the Triton kernel {kernel.__name__} failed: {type(error).__name__}: {error}') from error


def _or(tensor: Optional[torch.Tensor], placeholder: torch.Tensor) -> torch.Tensor:
    """A pointer argument the kernel does not read where `tensor` is None (its constant says so)."""
    return placeholder if tensor is None else tensor


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _flat(*tensors: torch.Tensor) -> bool:
    """Whether H and W of every tensor are one dimension (stride_h = W * stride_w)."""
    return all(t.shape[2] == 1 or t.stride(2) == t.shape[3] * t.stride(3) for t in tensors)


def _i64(*tensors: torch.Tensor) -> bool:
    """Whether an element offset of one of the tensors can reach 2^31: then the kernel computes offsets in 64 bits."""
    return any(sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) >= 2 ** 31 - 1
               for t in tensors)


def _same(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the tensors share `x`'s strides, so one tile of offsets serves them all."""
    return all(t.stride() == x.stride() for t in others)


def _tiles(channels: int, positions: int, x: torch.Tensor, tile: int = _TILE):
    """(BP, BC): a tile of at most `tile` elements, long in the dimension whose elements are adjacent in `x`
    (channels in channels-last)."""
    if x.stride(1) == 1 or positions == 1:
        bc = min(_pow2(channels), 128 if positions > 1 else tile)
        return min(_pow2(positions), max(1, tile // bc)), bc
    bp = min(_pow2(positions), 256)
    return bp, min(_pow2(channels), max(1, tile // bp))


def channel_sq_norm(x: torch.Tensor, groups: int, alpha: float = 1., beta: float = 0.) -> torch.Tensor:
    """`alpha * sum_{c in group} x^2 + beta` of an (N, C, H, W) tensor: (N, groups, H, W) float32, contiguous."""
    n, c, h, w = x.shape
    q = torch.empty((n, groups, h, w), device=x.device, dtype=torch.float32)
    cpg, p = c // groups, h * w
    grouped = cpg > 1
    bp, bc = _tiles(cpg if grouped else c, p, x)
    npb = triton.cdiv(p, bp)
    grid = (n * npb, groups if grouped else triton.cdiv(c, bc))
    _launch(_channel_sq_norm_kernel, grid, x, *x.stride(), q, c, p, w, cpg, groups, npb, alpha, beta,
            BP=bp, BC=bc, GROUPED=grouped, FLAT=_flat(x), I64=_i64(x, q), num_warps=_WARPS)
    return q


def box_filter(m: torch.Tensor, box: BoxFilter, size) -> torch.Tensor:
    """`box` applied to the map `m` (its squares where `box.squares`), every channel its own: a float32 map of (H, W)
    `size`, channels-last."""
    n, c = m.shape[:2]
    h, w = size
    r = torch.empty((n, c, h, w), device=m.device, dtype=torch.float32, memory_format=torch.channels_last)
    p = h * w
    bp, bc = _tiles(c, p, r, _TILE // 2)
    npb = triton.cdiv(p, bp)
    _launch(_box_filter_kernel, (n * npb, triton.cdiv(c, bc)), m, *m.stride(), r, *r.stride(), c, p, w, npb,
            *m.shape[2:], *box.stride, *box.padding, *box.dilation, 1. / box.divisor, box.offset,
            BP=bp, BC=bc, KH=box.kernel_size[0], KW=box.kernel_size[1], ADJOINT=box.adjoint, SQUARE=box.squares,
            FLAT=_flat(r), I64=_i64(m, r), num_warps=_WARPS)
    return r


def scale(y: torch.Tensor, m: torch.Tensor, post_bias: Optional[torch.Tensor] = None, act: str = 'none',
          alpha: float = 1., rsqrt: bool = True, base: Optional[torch.Tensor] = None,
          out: Optional[torch.Tensor] = None, gain: Optional[torch.Tensor] = None,
          bias: Optional[torch.Tensor] = None, box: Optional[BoxFilter] = None,
          partials: Optional[torch.Tensor] = None, sums: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ `act(base + alpha * gain * (y + bias) * m' + post_bias)` per channel of a 4-D `y`, `m' = rsqrt(m)` (`rsqrt`)
    or `m`, `m` with one channel per group, box-filtered first where `box` is given (and stored into `box.out`);
    into `out` (default: a new tensor in `y`'s layout and dtype).

    `partials`: `scale_backward`'s, summed over their dim 1 into `sums` (K, C) in the same launch."""
    n, c, h, w = y.shape
    if out is None:
        out = torch.empty_like(y)
    if box is None:
        m = m.contiguous()
    groups, p = m.shape[1], h * w
    # a box filter's window offsets per element: half the elements keep a thread's registers within 96
    bp, bc = _tiles(c, p, y, _TILE if box is None else _TILE // 2)
    npb = triton.cdiv(p, bp)
    others = (out,) if base is None else (out, base)
    base_args = (base, *base.stride()) if base is not None else (y, 0, 0, 0, 0)
    if box is None:
        box_args, box_kind, (kh, kw), m_out = (0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1., 0.), 0, (1, 1), None
    else:
        box_args = (*m.stride(), *m.shape[2:], *box.stride, *box.padding, *box.dilation, 1. / box.divisor,
                    box.offset)
        box_kind, (kh, kw), m_out = 2 if box.adjoint else 1, box.kernel_size, box.out
    grid = [n * npb, triton.cdiv(c, bc)]
    if partials is None:
        sum_args = (m, m, 0, 0, 0, 0)
    else:
        k, rows, channels = partials.shape
        sum_programs = triton.cdiv(triton.cdiv(k * channels, _SUM_COLUMNS), grid[1])
        grid[0] += sum_programs
        sum_args = (partials, sums, channels, rows, k * channels, sum_programs)
    _launch(
        _scale_kernel, tuple(grid),
        y, *y.stride(), m, _or(bias, m), _or(gain, m), _or(post_bias, m), *base_args, out, *out.stride(),
        _or(m_out, m), c, p, w, c // groups, groups, npb, alpha, *box_args, *sum_args,
        BP=bp, BC=bc, RSQRT=rsqrt, HAS_BIAS=bias is not None, HAS_GAIN=gain is not None,
        HAS_PB=post_bias is not None, HAS_BASE=base is not None, ACT=ACTIVATIONS[act],
        FLAT=_flat(y, *others), SAME=_same(y, *others), I64=_i64(y, m, *others), BOX=box_kind, KH=kh, KW=kw,
        SQUARE=box is not None and box.squares, STORE_M=m_out is not None, SUM=partials is not None,
        BR=_SUM_ROWS, BCOL=_SUM_COLUMNS, ONE_GROUP=groups == 1, num_warps=_WARPS)
    return out


def scale_backward(grad: torch.Tensor, y: torch.Tensor, b: torch.Tensor, post_bias: Optional[torch.Tensor],
                   act: str, post_bias_grad: bool, grad_y: Optional[torch.Tensor] = None,
                   gain: Optional[torch.Tensor] = None, gain_grad: bool = False, bias: Optional[torch.Tensor] = None,
                   bias_grad: bool = False):
    """ `(dL/dy, t, partials)` for `out = act(gain (y + bias) rsqrt(b) + post_bias)` (see `_scale_backward_kernel`);
    `t` is (N, G, H, W) float32, dL/dy (into `grad_y` if given) in `y`'s layout and dtype, `partials` a float32
    (K, R, C) tensor whose sum over dim 1 has the rows dL/dpost_bias, dL/dgain and dL/dbias (those asked for, in this
    order; `scale` sums them in its launch), or None."""
    n, c, h, w = y.shape
    b = b.contiguous()
    groups, p = b.shape[1], h * w
    cpg = c // groups
    grouped = cpg > 1
    same = _same(grad, y, grad_y if grad_y is not None else y)
    # the tile's three column sums carried over the program's units: half a tile keeps a thread's registers within
    # 96, a quarter where the layouts differ (three tiles of offsets)
    bp, bc = _tiles(cpg if grouped else c, p, y, _TILE // 2 if same else _TILE // 4)
    npb = triton.cdiv(p, bp)
    units = n * npb
    units_per_program = triton.cdiv(units, _PARTIAL_ROWS)
    grid = (triton.cdiv(units, units_per_program), groups if grouped else triton.cdiv(c, bc))
    if grad_y is None:
        grad_y = torch.empty_like(y)
    t = torch.empty_like(b)
    # the programs' partial sums of the parameters' gradients
    asked = (post_bias_grad, gain_grad, bias_grad)
    partials = torch.empty((sum(asked), grid[0], c), device=y.device, dtype=torch.float32)
    rows = iter(partials)
    post_bias_part, gain_part, bias_part = (next(rows) if wanted else t for wanted in asked)
    _launch(
        _scale_backward_kernel, grid,
        grad, *grad.stride(), y, *y.stride(), b, _or(bias, b), _or(gain, b), _or(post_bias, b),
        grad_y, *grad_y.stride(), t, post_bias_part, gain_part, bias_part, c, p, w, cpg, groups, npb, units,
        units_per_program,
        BP=bp, BC=bc, HAS_BIAS=bias is not None, HAS_GAIN=gain is not None, HAS_PB=post_bias is not None,
        ACT=ACTIVATIONS[act], WRITE_PB=post_bias_grad, WRITE_GAIN=gain_grad, WRITE_BIAS=bias_grad, GROUPED=grouped,
        UNITS_OUTER=grouped and bp > bc, FLAT=_flat(grad, y, grad_y), SAME=same, I64=_i64(grad, y, grad_y, b, partials),
        num_warps=_WARPS)
    return grad_y, t, partials if any(asked) else None
