"""Triton kernels for the streaming Sinkhorn passes (streaming.py gives the math of each pass).

Logits. Every kernel sees the dot-product logits A x.y (A = 2a for cost "l2", a for "dot", a the
logit scale); the l2 norms live in the potentials (streaming.py, reduced potentials), so no kernel
reads a norm. Exponentials are base 2: a tile is t = A log2(e) x.y + (potentials) log2(e), and
logsumexps are converted back to natural logs when stored, so every potential kept between kernels
is in natural-log units.

Softcap (CAP > 0, a constexpr; CAP_L2 for cost l2): every kernel forms the whole logit of a tile,
L = A x.y (dot) or -a |x - y|^2 from the dot and the two rows' norms (l2), and caps it, CAP tanh(L / CAP),
before the potentials and the mask; the host then keeps the norms out of the potentials (g^0 = 0), so
the passes above run unchanged on the capped logits. In _grad_qk_kernel dL is multiplied by the cap's
slope 1 - tanh^2 before it meets q and k (_scores).

Orientation. A kernel owns a block of BLOCK_X rows of X and streams over BLOCK_Y rows of Y; a row
pass over queries is launched on (X, Y) = (q, k), a column pass on (k, q) with the mask's strides
swapped: one kernel for both. Layout: X (BH, Nx, D), Y (BH, Ny, D) contiguous; per-row vectors
(BH, N) float32 (a potential of a stack (T, BH, N) is handed over as its slice); the mask a
(B, H, Nx, Ny) view given by strides (0 on broadcast dims), so a key-padding mask is read, never
expanded.

One shift per program, no running maximum. The Sinkhorn exponents have known upper bounds:
- a half-iteration after the first: the previous half-iteration's plan has entries <= 1 (a
  row-normalised plan R = exp(L + f + g) has rows summing to one, a column-normalised one columns
  summing to one), so the exponent L_ij + g_j of row i is at most c - f_i (row pass after a column
  pass), L_ij + f_i of column j at most -g_j (column pass after a row pass);
- in the backward every exponent is an entry of such a plan: at most 0.
A program takes s = the largest bound of its rows and sums exp2(t - s) directly: one FFMA (the
scaled dot plus a per-column vector), one exp2 and one add per logit, against a running maximum's
max, subtraction and rescaling (_lse_kernel, _attend_kernel, BOUNDED). Nothing overflows (every
term <= 1). If the block's bounds span more than SPREAD_MAX (40 in log2 units) each row is shifted
by its own bound instead (one more add per logit). A row whose sum still comes out below MIN_SUM
(2^-80: its bound is that loose, or it has no term) sends its program through the tiles again with
the running maximum, the exact logsumexp of before; what float32 flushes to zero (terms below
2^-126) is then at most N 2^-46 of any accepted sum. So the result is the exact logsumexp in every
case, and the second walk is the price of extreme inputs (eps = 0.05 with logits in the thousands,
fully masked rows). The weighted sums of the backward (_wsum_kernel, _grad_v_kernel) take their row
potential out of the exponent the same way (shift = the smallest row potential of the program,
per-row factor 2^(row - shift) after the walk) when the program's row potentials span at most
SPREAD_MAX (a term is then lost to underflow only below 2^-86), and add it per logit otherwise.
Each case is a uniform branch inside one loop: two pipelined loops in an if / else kept both loops'
shared buffers on sm_90. The unrolled adjoint's terms are a product of rank-one factors
(_factors_kernel, _grad_qk_kernel).

tune_nx / tune_ny: power-of-two buckets of Nx / Ny, unused by the code: the autotuning key, so a
new length retunes only when it changes bucket (triton.py).

Sliding windows (BAND, a constexpr; the band's two offsets left, right as in triton_logit_extras): a
program walks only the Y tiles that meet its X block's band (_band_span, the softmax family's
band_keys), unmasked inside every row's band, masked elementwise on the band's edges (_band_cut). A
column pass is the same test on the transposed problem (X = k, Y = q: the host swaps the offsets). A
program that walks no tile sums to 0: lse = 0 and a zero output row, as the band folded into the mask
gives. G0_MODE and DELTA_HERE (an O(N) vector written by the program that walks every y) are refused
with a band: the host computes those vectors first.

Out-of-range rows and columns need no 2-D bounds mask: the per-Y vectors are loaded with -inf
(or +inf for a subtracted log-normaliser) past the end, which makes every exponential there 0, and
the loaded X / Y rows are zeros there, so nothing is NaN. Masks (MASK_KIND 1 = bool as uint8,
2 = float with -inf for masked entries) are applied to t once per tile; a mask broadcast along
one axis of the tile (key padding, a per-query mask) is read as one vector.

Precision: dots take the input dtype with a float32 accumulator (tensor cores for fp16 / bf16;
``mm`` upcasts to float32 under TRITON_INTERPRET=1, whose bf16 dot is wrong); every exponential,
reduction and accumulator is float32 whatever dtype the host hands in (bf16 under autocast too).
The adjoint terms of _grad_qk_kernel are a float32 product of factor matrices, on the tensor
cores as three TF32 products (``tf32x3``, float32 accuracy).

Half inputs (issue 21). At small eps the backward's dL = dS - sum_t (C^t dg^t + R^t df^t) is a small
residual of large terms, and it cancels only if every term sees the same plan. The plan tile that
multiplies v (attend) or dout (_grad_v_kernel) goes to the tensor cores in the input dtype, while the
backward's other sums (delta's row sums, sum_y P delta, the dq / dk tiles) use the float32 plan; a
plan rounded to bf16's 8 bits there left dq / dk of the eps = 0.05 test at 7.7x / 23x the reference's
error. So with SPLIT_P (half inputs) the plan tile is taken as hi + lo parts in the dtype, two products
(_plan_product: ~16 bits), and the attend also stores its float32 output (OUT32), from which the
backward takes delta = dout.out. Each alone was not enough (measured: docs/kernels_sinkhorn.md).
fp16 has a narrow range: a plan tile shifted by a bound that is not its row's maximum (up to 2^-40
in a program) falls below fp16's smallest numbers, so fp16 inputs run the attend with the running
maximum and keep the row potential in _grad_v_kernel's exponent (the host decides, per dtype).

Packed sequences (VARLEN, CU_Q / CU_K and, for the passes launched both ways, X_IS_Q: the arguments at
the end of each signature; varlen.py launches them). The grid's batch-head index is sequence * H +
head; at its entry a program reads its sequence's starts and n_q / n_k from the offsets (``_packed_entry``),
returns when its block lies past the sequence, and moves its base pointers so that the unchanged body's
``bh * N`` indexing lands in the sequence's block: X / Y rows and every per-row vector are laid out in
per-sequence (H, n) blocks starting at row H * start (ops/triton_packed.py), the stacks the adjoint
terms read (_factors_kernel, _grad_qk_kernel) in per-sequence (T', H, n) blocks starting at T' H start
(the host regroups them; the body's stride between entries becomes H * n). The column target differs
per sequence: under VARLEN the host passes every scalar that is a multiple of c (ref_shift, out_shift,
shift, c) as that multiple, and the program multiplies it by its own c = log(n_q / n_k). The rest of
the kernel is the dense one on the sequence's n_q x n_k problem, so no tile crosses a boundary.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_logit_extras import band_keys, in_band, softcap_tile
from ..triton_utils import mm, mma, packed_sequence

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_rows(ptr, offs, n, offs_d, d):
    return tl.load(ptr + offs[:, None] * d + offs_d[None, :], mask=(offs[:, None] < n) & (offs_d[None, :] < d),
                   other=0.0)


@triton.jit
def _load_vec(ptr, offs, n, fill):
    return tl.load(ptr + offs, mask=offs < n, other=fill)


@triton.jit
def _packed_entry(CU_Q, CU_K, bh, H, X_IS_Q: tl.constexpr):
    """VARLEN (packed sequences, module doc): program bh = sequence * H + head's (sx, nx, sy, ny, c, hx, hy).
    sx / sy move a per-row pointer of the X / Y side from the kernels' bh * N indexing to the sequence's
    (H, n) block, which starts at row H * start: sx = H * start_x - sequence * H * n_x (times the row
    width for X / Y rows themselves); nx / ny are the sequence's lengths, c = log(n_q / n_k) its column
    target, hx / hy = H * start (a stack of T' entries per sequence starts T' H start: sx + (T' - 1) hx)."""
    seq = bh // H
    start_q, n_q, start_k, n_k = packed_sequence(CU_Q, CU_K, seq)
    c = tl.log(n_q.to(tl.float32) / n_k.to(tl.float32))
    if X_IS_Q:
        start_x, nx, start_y, ny = start_q, n_q, start_k, n_k
    else:
        start_x, nx, start_y, ny = start_k, n_k, start_q, n_q
    return H * start_x - seq * H * nx, nx, H * start_y - seq * H * ny, ny, c, H * start_x, H * start_y


@triton.jit
def _plan_product(p, b, acc, SPLIT_P: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + p @ b for a float32 plan tile p and a tile b in the input dtype, on the tensor cores with p
    in b's dtype. SPLIT_P (half inputs): p as hi + lo parts in that dtype (hi = p rounded, lo = the
    rounded rest), two products: ~16 significant bits of p instead of 8 (bf16) / 11 (fp16). The
    backward's column adjoint v.dv - sum P delta and the dq / dk terms cancel to a small residual at
    small eps, so a plan rounded to 8 bits here is not cancelled by the float32 plan there (module doc)."""
    hi = p.to(b.dtype)
    acc = mma(hi, b, acc, UPCAST, PRECISION)
    if SPLIT_P:
        acc = mma((p - hi.to(tl.float32)).to(b.dtype), b, acc, UPCAST, PRECISION)
    return acc


@triton.jit
def _apply_mask(t, MASK, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr):
    """t (log2 units) with the attention mask: -inf where masked, a float mask's value added.
    MASK_SHAPE 1: the mask is constant along x (sm_x == 0, e.g. key padding in a row pass) and is
    read as one vector over y; 2: constant along y (sm_y == 0), one vector over x; 0: a full tile."""
    if MASK_KIND != 0:
        if MASK_SHAPE == 1:
            mv = tl.load(MASK + offs_y * sm_y, mask=offs_y < Ny, other=0)[None, :]
        elif MASK_SHAPE == 2:
            mv = tl.load(MASK + offs_x * sm_x, mask=offs_x < Nx, other=0)[:, None]
        else:
            mv = tl.load(MASK + offs_x[:, None] * sm_x + offs_y[None, :] * sm_y,
                         mask=(offs_x[:, None] < Nx) & (offs_y[None, :] < Ny), other=0)
        if MASK_KIND == 1:
            t = tl.where(mv != 0, t, float("-inf"))
        else:  # -inf entries give -inf; finite ones shift the logit
            t = t + mv.to(tl.float32) * LOG2E
    return t


@triton.jit
def _scores(x, y, a2, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr, CAP_L2: tl.constexpr):
    """(the logit tile in log2 units, before potentials and mask; the softcap's slope, 1.0 without).
    Without a cap: a2 x.y, the reduced logit (the norms live in the potentials). With CAP (the softcap,
    a constexpr: one model has one) the whole logit is capped, so it is formed here: L = A x.y for
    cost dot, L = A (x.y - |x|^2 / 2 - |y|^2 / 2) = -a |x - y|^2 for l2 (CAP_L2; the host then keeps
    the norms out of the potentials, g^0 = 0), and CAP tanh(L / CAP) is returned."""
    d = mm(x, tl.trans(y), UPCAST, PRECISION)
    if CAP > 0:
        if CAP_L2:
            xf = x.to(tl.float32)
            yf = y.to(tl.float32)
            d = d - 0.5 * (tl.sum(xf * xf, 1)[:, None] + tl.sum(yf * yf, 1)[None, :])
        capped, slope = softcap_tile(d * (a2 / LOG2E), CAP)
        t = capped * LOG2E
    else:  # one return: the compiler unifies every return's type, even in a branch it leaves out
        t = d * a2
        slope = 1.0
    return t, slope


@triton.jit
def _logits(x, y, a2, col, Mh, y0, offs_x, offs_y, Nx, Ny, sm_x, sm_y, band, MASK_KIND: tl.constexpr,
            MASK_SHAPE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr,
            CAP_L2: tl.constexpr, BAND: tl.constexpr, BLOCK_Y: tl.constexpr):
    """The tile a2 x.y + col_y (log2 units: one FFMA per logit; capped: ``_scores``) with the mask
    applied, and the band (``_band_cut``)."""
    t, _ = _scores(x, y, a2, UPCAST, PRECISION, CAP, CAP_L2)
    t = _apply_mask(t + col[None, :], Mh, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND, MASK_SHAPE)
    return _band_cut(t, y0, offs_x, offs_y, Nx, Ny, band, BAND, BLOCK_Y)


@triton.jit
def _band_span(start_x, Nx, Ny, left, right, BAND: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr):
    """(lo, hi, a, b, left, right): the block of X rows from start_x walks the Y rows [lo, hi); the
    tiles inside [a, b) are whole and inside every row's band (unmasked), the others are its edges.
    Without a band (BAND False) every Y row, all interior. A row pass (X = q) gets the window's
    (left, right), a column pass (X = k) the transposed band (right, left): the same test with the
    roles of the two sides swapped (module doc)."""
    if BAND:
        lo, a, b, hi = band_keys(start_x, Nx, Ny, left, right, BLOCK_X, BLOCK_Y)
    else:
        lo = 0
        a = 0
        b = Ny
        hi = Ny
    return lo, hi, a, b, left, right


@triton.jit
def _band_cut(t, y0, offs_x, offs_y, Nx, Ny, band, BAND: tl.constexpr, BLOCK_Y: tl.constexpr):
    """t with -inf outside the band, on the band's edge tiles only (the tile of Y rows from y0; a
    uniform branch per tile)."""
    if BAND:
        lo, hi, a, b, left, right = band
        if (y0 < a) | (y0 + BLOCK_Y > b):
            t = tl.where(in_band(offs_x[:, None], offs_y[None, :], Nx, Ny, left, right), t, float("-inf"))
    return t


@triton.jit
def _row_shifts(REF, offs_x, Nx, ref_shift, SPREAD_MAX: tl.constexpr):
    """(shift, per_row): the exponent bounds ref_shift - REF_x of the block's rows (log2 units) and
    whether the block needs them per row: one shift (their maximum) serves the block when they span
    at most SPREAD_MAX, else each row is shifted by its own bound (one more add per logit)."""
    bound = (ref_shift - _load_vec(REF, offs_x, Nx, float("inf"))) * LOG2E
    top = tl.max(bound, 0)
    bound = tl.where(offs_x < Nx, bound, top)   # rows past Nx (never stored) get a finite shift too
    per_row = top - tl.min(bound, 0) > SPREAD_MAX
    return tl.where(per_row, bound, top), per_row


@triton.jit
def _needs_second_walk(l, offs_x, Nx, MIN_SUM: tl.constexpr):
    """Some row of the block summed to less than MIN_SUM (or to NaN): walk again with a running maximum."""
    small = (l < MIN_SUM) | (l != l)
    return tl.max(tl.where(offs_x < Nx, small, False).to(tl.int32), 0) != 0


@triton.jit
def _lse_finish(m, l, out_shift):
    """out_shift - lse (natural log) from a reference m and the sum l of exp2(t - m); lse = 0 where
    no y takes part (l == 0). A NaN l (a NaN logit) stays NaN: it is not an empty row."""
    nonempty = l != 0
    lse = tl.where(nonempty, (m + tl.log2(tl.where(nonempty, l, 1.0))) * LN2, 0.0)
    return out_shift - lse


@triton.jit
def _lse_online(x, Yh, OTHER, g0_here, Mh, offs_x, offs_d, Nx, Ny, D, a2, half_a, sm_x, sm_y, band,
                MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, G0_MODE: tl.constexpr, BLOCK_X: tl.constexpr,
                BLOCK_Y: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr,
                CAP_L2: tl.constexpr, BAND: tl.constexpr):
    """(m, l): running maximum and sum of exp2(t - m) over every y. G0_MODE 0: the per-y vector is
    read from OTHER; 1: it is 0 (g^0, cost dot); 2: it is -a |y|^2 (g^0, reduced l2), computed from
    the loaded rows; in modes 1 and 2 program g0_here (the first of each batch-head) stores it to
    OTHER for the backward."""
    m = tl.full([BLOCK_X], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_X], tl.float32)
    for y0 in range(band[0], band[1], BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        if G0_MODE == 0:
            col = _load_vec(OTHER, offs_y, Ny, float("-inf")) * LOG2E
        else:
            if G0_MODE == 1:
                g0 = tl.zeros([BLOCK_Y], tl.float32)
            else:
                yf = y.to(tl.float32)
                g0 = -half_a * tl.sum(yf * yf, 1)
            tl.store(OTHER + offs_y, g0, mask=(offs_y < Ny) & g0_here)
            col = tl.where(offs_y < Ny, g0 * LOG2E, float("-inf"))
        t = _logits(x, y, a2, col, Mh, y0, offs_x, offs_y, Nx, Ny, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE,
                    UPCAST, PRECISION, CAP, CAP_L2, BAND, BLOCK_Y)
        m_new = tl.maximum(m, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(t - m_safe[:, None]), 1)
        m = m_new
    return tl.where(m == float("-inf"), 0.0, m), l


@triton.jit
def _lse_shifted(x, Yh, OTHER, s, s_row, per_row, Mh, offs_x, offs_d, Nx, Ny, D, a2, sm_x, sm_y, band,
                 MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, BLOCK_X: tl.constexpr,
                 BLOCK_Y: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr,
                 CAP_L2: tl.constexpr, BAND: tl.constexpr):
    """sum over y of exp2(t - s) (per_row: exp2(t - s_row_x)), the shift an upper bound of every t.
    One loop with a uniform branch per tile, not one loop per case: sm_90 would hold the pipelined
    buffers of both loops at once."""
    l = tl.zeros([BLOCK_X], tl.float32)
    for y0 in range(band[0], band[1], BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        col = _load_vec(OTHER, offs_y, Ny, float("-inf")) * LOG2E - s
        t = _logits(x, y, a2, col, Mh, y0, offs_x, offs_y, Nx, Ny, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE,
                    UPCAST, PRECISION, CAP, CAP_L2, BAND, BLOCK_Y)
        if per_row:
            t = t - s_row[:, None]
        l += tl.sum(tl.exp2(t), 1)
    return l


@triton.jit
def _lse_kernel(X, Y, OTHER, REF, OUT, MASK, H, Nx, Ny, D, A, ref_shift, out_shift,
                sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, BOUNDED: tl.constexpr, G0_MODE: tl.constexpr,
                MIN_SUM: tl.constexpr, SPREAD_MAX: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr,
                BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr,
                CAP_L2: tl.constexpr, left=0, right=0, BAND: tl.constexpr = False,
                CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False, X_IS_Q: tl.constexpr = True):
    """OUT_x = out_shift - lse_y(A x.y + OTHER_y) over the y taking part (natural log; lse = 0 where
    none does): f = -lse (row pass, out_shift 0) or g = c - lse (column pass, out_shift c).
    BOUNDED: ref_shift - REF_x bounds every exponent of row x (module doc), the block is summed
    under one shift and walked again with a running maximum only if a row's sum is below MIN_SUM.
    G0_MODE (first row pass only, see _lse_online): OTHER is g^0, computed here and stored."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    ref_shift = tl.cast(ref_shift, tl.float32)
    out_shift = tl.cast(out_shift, tl.float32)
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    if VARLEN:  # bh = sequence * H + head: its lengths, (H, n) blocks and column target (X_IS_Q: a row pass)
        sx, Nx, sy, Ny, c, _, _ = _packed_entry(CU_Q, CU_K, bh, H, X_IS_Q)
        if pid * BLOCK_X >= Nx:
            return
        X += sx * D
        Y += sy * D
        OTHER += sy
        REF += sx
        OUT += sx
        ref_shift *= c
        out_shift *= c
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    OTHER = OTHER + bh * Ny
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    band = _band_span(pid * BLOCK_X, Nx, Ny, left, right, BAND, BLOCK_X, BLOCK_Y)
    offs_d = tl.arange(0, BLOCK_D)
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    a2 = A * LOG2E
    if BOUNDED:
        m, per_row = _row_shifts(REF + bh * Nx, offs_x, Nx, ref_shift, SPREAD_MAX)
        l = _lse_shifted(x, Yh, OTHER, tl.where(per_row, 0.0, tl.max(m, 0)), m, per_row, Mh, offs_x, offs_d, Nx, Ny,
                         D, a2, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE, BLOCK_X, BLOCK_Y, UPCAST, PRECISION, CAP,
                         CAP_L2, BAND)
        if _needs_second_walk(l, offs_x, Nx, MIN_SUM):
            m, l = _lse_online(x, Yh, OTHER, pid == 0, Mh, offs_x, offs_d, Nx, Ny, D, a2, 0.5 * A, sm_x, sm_y, band,
                               MASK_KIND, MASK_SHAPE, 0, BLOCK_X, BLOCK_Y, UPCAST, PRECISION, CAP, CAP_L2, BAND)
    else:
        # G0_MODE stores g^0 from the program that walks every y: never with a band (the host computes it)
        tl.static_assert(G0_MODE == 0 or not BAND)
        m, l = _lse_online(x, Yh, OTHER, pid == 0, Mh, offs_x, offs_d, Nx, Ny, D, a2, 0.5 * A, sm_x, sm_y, band,
                           MASK_KIND, MASK_SHAPE, G0_MODE, BLOCK_X, BLOCK_Y, UPCAST, PRECISION, CAP, CAP_L2, BAND)
    tl.store(OUT + bh * Nx + offs_x, _lse_finish(m, l, out_shift), mask=offs_x < Nx)


@triton.jit
def _wsum_walk(x, Yh, YP, W, inner, s, row_in_exp, Mh, offs_x, offs_d, Nx, Ny, D, a2, sm_x, sm_y, band,
               MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, BLOCK_X: tl.constexpr,
               BLOCK_Y: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr,
               CAP_L2: tl.constexpr, BAND: tl.constexpr):
    """sum_y exp2(A' x.y + YP_y + s [+ inner_x if row_in_exp]) W_y, accumulated per logit (one FFMA);
    one loop with a uniform branch per tile (see _lse_shifted)."""
    acc = tl.zeros([BLOCK_X, BLOCK_Y], tl.float32)
    for y0 in range(band[0], band[1], BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        col = _load_vec(YP, offs_y, Ny, float("-inf")) * LOG2E + s
        w = _load_vec(W, offs_y, Ny, 0.0)
        t = _logits(x, y, a2, col, Mh, y0, offs_x, offs_y, Nx, Ny, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE,
                    UPCAST, PRECISION, CAP, CAP_L2, BAND, BLOCK_Y)
        if row_in_exp:
            t = t + inner[:, None]
        acc += tl.exp2(t) * w[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _wsum_kernel(X, Y, XP, YP, W, OUT, MASK, H, Nx, Ny, D, A, shift, out_scale,
                 sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                 MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, SPREAD_MAX: tl.constexpr,
                 BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr, CAP_L2: tl.constexpr,
                 left=0, right=0, BAND: tl.constexpr = False,
                 CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False, X_IS_Q: tl.constexpr = True):
    """OUT_x = out_scale sum_y exp(A x.y + XP_x + YP_y + shift) W_y. The callers' exponents are
    entries of a transport plan (<= 1 up to rounding), so no running maximum is needed; with
    s = min over the block of XP_x, exp2(t + s) <= 1 too and the row factor exp2(XP_x - s) comes
    out of the sum (module doc), unless the block's XP span more than SPREAD_MAX."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    shift = tl.cast(shift, tl.float32)
    out_scale = tl.cast(out_scale, tl.float32)
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    if VARLEN:  # bh = sequence * H + head (see _lse_kernel)
        sx, Nx, sy, Ny, c, _, _ = _packed_entry(CU_Q, CU_K, bh, H, X_IS_Q)
        if pid * BLOCK_X >= Nx:
            return
        X += sx * D
        Y += sy * D
        XP += sx
        YP += sy
        W += sy
        OUT += sx
        shift *= c
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    band = _band_span(pid * BLOCK_X, Nx, Ny, left, right, BAND, BLOCK_X, BLOCK_Y)
    offs_d = tl.arange(0, BLOCK_D)
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    xp = (_load_vec(XP + bh * Nx, offs_x, Nx, 0.0) + shift) * LOG2E
    in_x = offs_x < Nx
    s = tl.min(tl.where(in_x, xp, float("inf")), 0)
    a2 = A * LOG2E
    factor_out = tl.max(tl.where(in_x, xp, float("-inf")), 0) - s <= SPREAD_MAX   # False for NaN: exact walk
    s = tl.where(factor_out, s, 0.0)
    out = _wsum_walk(x, Yh, YP + bh * Ny, W + bh * Ny, xp, s, not factor_out, Mh, offs_x, offs_d, Nx, Ny, D, a2,
                     sm_x, sm_y, band, MASK_KIND, MASK_SHAPE, BLOCK_X, BLOCK_Y, UPCAST, PRECISION, CAP, CAP_L2,
                     BAND)
    out = out * tl.exp2(tl.where(factor_out, xp - s, 0.0))
    tl.store(OUT + bh * Nx + offs_x, out * out_scale, mask=in_x)


@triton.jit
def _attend_online(x, Yh, Vh, G, Mh, offs_x, offs_d, offs_dv, Nx, Ny, D, DV, a2, sm_x, sm_y, band,
                   MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr,
                   BLOCK_DV: tl.constexpr, SPLIT_P: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   CAP: tl.constexpr, CAP_L2: tl.constexpr, BAND: tl.constexpr):
    """(m, l, acc) of FlashAttention's online softmax over the tiles of A x.y + G_y."""
    m = tl.full([BLOCK_X], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_X], tl.float32)
    acc = tl.zeros([BLOCK_X, BLOCK_DV], tl.float32)
    for y0 in range(band[0], band[1], BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        col = _load_vec(G, offs_y, Ny, float("-inf")) * LOG2E
        t = _logits(x, y, a2, col, Mh, y0, offs_x, offs_y, Nx, Ny, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE,
                    UPCAST, PRECISION, CAP, CAP_L2, BAND, BLOCK_Y)
        m_new = tl.maximum(m, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(t - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = _load_rows(Vh, offs_y, Ny, offs_dv, DV)
        acc = _plan_product(p, v, acc * alpha[:, None], SPLIT_P, UPCAST, PRECISION)
        m = m_new
    return tl.where(m == float("-inf"), 0.0, m), l, acc


@triton.jit
def _attend_shifted(x, Yh, Vh, G, s, s_row, per_row, Mh, offs_x, offs_d, offs_dv, Nx, Ny, D, DV, a2, sm_x, sm_y,
                    band, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, BLOCK_X: tl.constexpr,
                    BLOCK_Y: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT_P: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr, CAP: tl.constexpr, CAP_L2: tl.constexpr, BAND: tl.constexpr):
    """(l, acc): sums of exp2(t - s) and of exp2(t - s) V_y (per_row: s_row_x), the shift an upper
    bound of every t of its row (one loop, as _lse_shifted)."""
    l = tl.zeros([BLOCK_X], tl.float32)
    acc = tl.zeros([BLOCK_X, BLOCK_DV], tl.float32)
    for y0 in range(band[0], band[1], BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        col = _load_vec(G, offs_y, Ny, float("-inf")) * LOG2E - s
        t = _logits(x, y, a2, col, Mh, y0, offs_x, offs_y, Nx, Ny, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE,
                    UPCAST, PRECISION, CAP, CAP_L2, BAND, BLOCK_Y)
        if per_row:
            t = t - s_row[:, None]
        p = tl.exp2(t)
        l += tl.sum(p, 1)
        v = _load_rows(Vh, offs_y, Ny, offs_dv, DV)
        acc = _plan_product(p, v, acc, SPLIT_P, UPCAST, PRECISION)
    return l, acc


@triton.jit
def _attend_kernel(X, Y, V, G, REF, OUT, OUT32, LSE, MASK, H, Nx, Ny, D, DV, A, ref_shift,
                   sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                   MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, BOUNDED: tl.constexpr, MIN_SUM: tl.constexpr,
                   SPREAD_MAX: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, SPLIT_P: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   CAP: tl.constexpr, CAP_L2: tl.constexpr, left=0, right=0, BAND: tl.constexpr = False,
                   CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
    """The final row pass, X = q, Y = k: OUT_x = sum_y softmax_y(A x.y + G_y) V_y and LSE_x of that
    softmax; zeros for an empty row. BOUNDED (n_iters >= 1): ref_shift - REF_x = c - f^T_x bounds
    the exponents of row x (the last column pass normalised the columns), so the block is summed
    under one shift with no rescaling of the accumulator, and walked again with FlashAttention's
    online softmax only if a row's sum is below MIN_SUM."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    ref_shift = tl.cast(ref_shift, tl.float32)
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    if VARLEN:  # bh = sequence * H + head (see _lse_kernel); X = q
        sx, Nx, sy, Ny, c, _, _ = _packed_entry(CU_Q, CU_K, bh, H, True)
        if pid * BLOCK_X >= Nx:
            return
        X += sx * D
        Y += sy * D
        V += sy * DV
        G += sy
        REF += sx
        LSE += sx
        OUT += sx * DV
        OUT32 += sx * DV
        ref_shift *= c
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    Vh = V + bh * Ny * DV
    G = G + bh * Ny
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    band = _band_span(pid * BLOCK_X, Nx, Ny, left, right, BAND, BLOCK_X, BLOCK_Y)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    a2 = A * LOG2E
    if BOUNDED:
        m, per_row = _row_shifts(REF + bh * Nx, offs_x, Nx, ref_shift, SPREAD_MAX)
        l, acc = _attend_shifted(x, Yh, Vh, G, tl.where(per_row, 0.0, tl.max(m, 0)), m, per_row, Mh, offs_x, offs_d,
                                 offs_dv, Nx, Ny, D, DV, a2, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE, BLOCK_X,
                                 BLOCK_Y, BLOCK_DV, SPLIT_P, UPCAST, PRECISION, CAP, CAP_L2, BAND)
        if _needs_second_walk(l, offs_x, Nx, MIN_SUM):
            m, l, acc = _attend_online(x, Yh, Vh, G, Mh, offs_x, offs_d, offs_dv, Nx, Ny, D, DV, a2, sm_x, sm_y,
                                       band, MASK_KIND, MASK_SHAPE, BLOCK_X, BLOCK_Y, BLOCK_DV, SPLIT_P, UPCAST,
                                       PRECISION, CAP, CAP_L2, BAND)
    else:
        m, l, acc = _attend_online(x, Yh, Vh, G, Mh, offs_x, offs_d, offs_dv, Nx, Ny, D, DV, a2, sm_x, sm_y, band,
                                   MASK_KIND, MASK_SHAPE, BLOCK_X, BLOCK_Y, BLOCK_DV, SPLIT_P, UPCAST, PRECISION, CAP,
                                   CAP_L2, BAND)
    nonempty = l != 0  # a NaN l (a NaN logit) stays NaN, it is not an empty row
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    tl.store(LSE + bh * Nx + offs_x, tl.where(nonempty, (m + tl.log2(l_safe)) * LN2, 0.0), mask=offs_x < Nx)
    out_at = bh * Nx * DV + offs_x[:, None] * DV + offs_dv[None, :]
    tl.store(OUT + out_at, out.to(OUT.dtype.element_ty), mask=(offs_x[:, None] < Nx) & (offs_dv[None, :] < DV))
    if SPLIT_P:  # the unrounded output too: the backward's delta = dout.out (see _plan_product)
        tl.store(OUT32 + out_at, out, mask=(offs_x[:, None] < Nx) & (offs_dv[None, :] < DV))


@triton.jit
def _row_dot_kernel(A, B, OUT, R, D, scale, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT_r = scale sum_d A_rd B_rd in float32 over R rows of width D (dout.out for the backward,
    g^0 = -a |k|^2 for a large l2 forward)."""
    scale = tl.cast(scale, tl.float32)
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    a = _load_rows(A, offs_r, R, offs_d, D).to(tl.float32)
    b = _load_rows(B, offs_r, R, offs_d, D).to(tl.float32)
    tl.store(OUT + offs_r, tl.sum(a * b, 1) * scale, mask=offs_r < R)


@triton.jit
def _grad_v_walk(x, Yh, DOh, Oh, LSE, DELTA, inner, s, row_in_exp, store_delta, Mh, offs_x, offs_d, offs_dv, Nx, Ny,
                 D, DV, a2, sm_x, sm_y, band, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                 DELTA_HERE: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_DV: tl.constexpr,
                 SPLIT_P: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAP: tl.constexpr,
                 CAP_L2: tl.constexpr, BAND: tl.constexpr):
    """(sum_y P'_yx dout_y, sum_y P'_yx DELTA_y) with P'_yx = exp2(A' x.y - LSE_y + s [+ inner_x if
    row_in_exp]); one loop with a uniform branch per tile (see _lse_shifted)."""
    dv = tl.zeros([BLOCK_X, BLOCK_DV], tl.float32)
    pd = tl.zeros([BLOCK_X, BLOCK_Y], tl.float32)
    for y0 in range(band[0], band[1], BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        col = s - _load_vec(LSE, offs_y, Ny, float("inf")) * LOG2E
        t = _logits(x, y, a2, col, Mh, y0, offs_x, offs_y, Nx, Ny, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE,
                    UPCAST, PRECISION, CAP, CAP_L2, BAND, BLOCK_Y)
        if row_in_exp:
            t = t + inner[:, None]
        p = tl.exp2(t)
        do = _load_rows(DOh, offs_y, Ny, offs_dv, DV)
        if DELTA_HERE:
            o = _load_rows(Oh, offs_y, Ny, offs_dv, DV)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            tl.store(DELTA + offs_y, delta, mask=(offs_y < Ny) & store_delta)
        else:
            delta = _load_vec(DELTA, offs_y, Ny, 0.0)
        dv = _plan_product(p, do, dv, SPLIT_P, UPCAST, PRECISION)
        pd += p * delta[None, :]
    return dv, tl.sum(pd, 1)


@triton.jit
def _grad_v_kernel(X, Y, V, DO, O, G, LSE, DELTA, DVOUT, DG, MASK, H, Nx, Ny, D, DV, A,
                   sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                   MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, DELTA_HERE: tl.constexpr,
                   SPREAD_MAX: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, SPLIT_P: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   CAP: tl.constexpr, CAP_L2: tl.constexpr, left=0, right=0, BAND: tl.constexpr = False,
                   CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
    """X = k (this program's keys), Y = q streamed. With the final plan P_yx = exp(A x.y + G_x - LSE_y):
    DVOUT_x = sum_y P_yx dout_y (in V's dtype) and DG_x = sum_y dS_yx = v_x . dV_x - sum_y P_yx DELTA_y,
    the adjoint of the last column potential (dS = P (dout.v - DELTA) summed over queries).
    DELTA_HERE: DELTA_y = dout_y . O_y is computed from the streamed tiles (and stored by the first
    program of each batch-head) instead of read. G_x leaves the exponent as in _wsum_kernel."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    if VARLEN:  # bh = sequence * H + head (see _lse_kernel); X = k
        sx, Nx, sy, Ny, _, _, _ = _packed_entry(CU_Q, CU_K, bh, H, False)
        if pid * BLOCK_X >= Nx:
            return
        X += sx * D
        Y += sy * D
        V += sx * DV
        DO += sy * DV
        O += sy * DV
        G += sx
        LSE += sy
        DELTA += sy
        DVOUT += sx * DV
        DG += sx
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    DOh, Oh = DO + bh * Ny * DV, O + bh * Ny * DV
    LSE, DELTA = LSE + bh * Ny, DELTA + bh * Ny
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    band = _band_span(pid * BLOCK_X, Nx, Ny, left, right, BAND, BLOCK_X, BLOCK_Y)
    # DELTA_HERE stores delta from the program that walks every y: never with a band (the host computes it)
    tl.static_assert(not (DELTA_HERE and BAND))
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_x = offs_x < Nx
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    g = _load_vec(G + bh * Nx, offs_x, Nx, float("-inf")) * LOG2E
    s = tl.min(tl.where(in_x, g, float("inf")), 0)
    a2 = A * LOG2E
    factor_out = tl.max(tl.where(in_x, g, float("-inf")), 0) - s <= SPREAD_MAX   # False for NaN: exact walk
    s = tl.where(factor_out, s, 0.0)
    dv, pd = _grad_v_walk(x, Yh, DOh, Oh, LSE, DELTA, g, s, not factor_out, pid == 0, Mh, offs_x, offs_d, offs_dv, Nx,
                          Ny, D, DV, a2, sm_x, sm_y, band, MASK_KIND, MASK_SHAPE, DELTA_HERE, BLOCK_X, BLOCK_Y,
                          BLOCK_DV, SPLIT_P, UPCAST, PRECISION, CAP, CAP_L2, BAND)
    row = tl.exp2(tl.where(factor_out, g - s, 0.0))
    dv = dv * row[:, None]
    pd = pd * row
    v = _load_rows(V + bh * Nx * DV, offs_x, Nx, offs_dv, DV).to(tl.float32)
    tl.store(DG + bh * Nx + offs_x, tl.sum(v * dv, 1) - pd, mask=in_x)
    tl.store(DVOUT + bh * Nx * DV + offs_x[:, None] * DV + offs_dv[None, :], dv.to(DVOUT.dtype.element_ty),
             mask=(offs_x[:, None] < Nx) & (offs_dv[None, :] < DV))


@triton.jit
def _factors_kernel(FS, GS, LSE, DFS, DGS, XF, UF, FAST, T, Nq, Nk, c,
                    FACTOR_MAX: tl.constexpr, BLOCK: tl.constexpr, HEADS=1, CU_Q=None, CU_K=None,
                    VARLEN: tl.constexpr = False):
    """Rank-one factors of the unrolled adjoint's terms, one program per (t, batch-head).

    With P = exp(L + g^T_j - lse_i) the final plan, every term plan of iteration t is P times a
    rank-one matrix: C^t_ij = exp(L + f^t_i + g^t_j - c) = P_ij 2^(a_i + b_j), R^t_ij =
    exp(L + f^t_i + g^{t-1}_j) = P_ij 2^(a_i + r_j), with (log2 units) a_i = f^t_i + lse_i,
    b_j = g^t_j - c - g^T_j, r_j = g^{t-1}_j - g^T_j. So C^t dg^t_j + R^t df^t_i = P_ij (XF_i0 UF_j0 +
    XF_i1 UF_j1) with S = max_i a_i and

        XF_i0 = 2^(a_i - S) (<= 1),  XF_i1 = XF_i0 df_i,  UF_j0 = 2^(b_j + S) dg_j,  UF_j1 = 2^(r_j + S)

    (columns 2t and 2t + 1 of XF (BH, Nq, 2T) and UF (BH, Nk, 2T)). Exact as long as no factor
    overflows: FAST[t, bh] = 1 when S + max_j max(b_j, r_j) <= FACTOR_MAX (58 in log2 units: C^t and
    R^t never exceed P by more than 2^58, so every term lost to underflow is below 2^-68); otherwise
    the factors are zeros and _grad_qk_kernel takes that term by its own exponential."""
    t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    BH = tl.num_programs(1)
    c = tl.cast(c, tl.float32) * LOG2E
    if VARLEN:  # bh = sequence * HEADS + head; the stacks per sequence, (T', HEADS, n) from T' HEADS start
        sq, Nq, sk, Nk, cs, hq, hk = _packed_entry(CU_Q, CU_K, bh, HEADS, True)
        c *= cs
        FS += sq + (T - 1) * hq
        DFS += sq + (T - 1) * hq
        GS += sk + T * hk
        DGS += sk + (T - 1) * hk
        LSE += sq
        XF += sq * 2 * T
        UF += sk * 2 * T
        FAST += (bh // HEADS) * HEADS * (T - 1)   # (T, HEADS) per sequence
        BH = HEADS   # entry t of a stack lies t * HEADS * n past the sequence's block
    F = FS + (t * BH + bh) * Nq
    DF = DFS + (t * BH + bh) * Nq
    GR = GS + (t * BH + bh) * Nk          # g^{t-1} (this iteration's row pass saw it)
    GC = GS + ((t + 1) * BH + bh) * Nk    # g^t
    GT = GS + (T * BH + bh) * Nk          # the final g
    DG = DGS + (t * BH + bh) * Nk
    LS = LSE + bh * Nq
    offs = tl.arange(0, BLOCK)
    top_a = tl.full([BLOCK], float("-inf"), tl.float32)
    for i0 in range(0, Nq, BLOCK):
        i = i0 + offs
        a = (_load_vec(F, i, Nq, float("-inf")) + _load_vec(LS, i, Nq, 0.0)) * LOG2E
        top_a = tl.maximum(top_a, a)
    S = tl.max(top_a, 0)
    top_k = tl.full([BLOCK], float("-inf"), tl.float32)
    for j0 in range(0, Nk, BLOCK):
        j = j0 + offs
        gt = _load_vec(GT, j, Nk, 0.0)
        b = (_load_vec(GC, j, Nk, 0.0) - gt) * LOG2E - c
        r = (_load_vec(GR, j, Nk, 0.0) - gt) * LOG2E
        top_k = tl.maximum(top_k, tl.where(j < Nk, tl.maximum(b, r), float("-inf")))
    fast = S + tl.max(top_k, 0) <= FACTOR_MAX      # False for NaN
    S = tl.where(fast, S, 0.0)
    on = tl.where(fast, 1.0, 0.0)
    tl.store(FAST + t * BH + bh, fast.to(tl.int32))
    X0 = XF + bh * Nq * 2 * T + 2 * t
    for i0 in range(0, Nq, BLOCK):
        i = i0 + offs
        a = (_load_vec(F, i, Nq, float("-inf")) + _load_vec(LS, i, Nq, 0.0)) * LOG2E
        xf = tl.where(fast, tl.exp2(a - S), 0.0)
        tl.store(X0 + i * 2 * T, xf, mask=i < Nq)
        tl.store(X0 + i * 2 * T + 1, xf * _load_vec(DF, i, Nq, 0.0), mask=i < Nq)
    U0 = UF + bh * Nk * 2 * T + 2 * t
    for j0 in range(0, Nk, BLOCK):
        j = j0 + offs
        gt = _load_vec(GT, j, Nk, 0.0)
        b = (_load_vec(GC, j, Nk, 0.0) - gt) * LOG2E - c
        r = (_load_vec(GR, j, Nk, 0.0) - gt) * LOG2E
        tl.store(U0 + j * 2 * T, on * tl.exp2(tl.minimum(b + S, 0.0 + FACTOR_MAX)) * _load_vec(DG, j, Nk, 0.0),
                 mask=j < Nk)
        tl.store(U0 + j * 2 * T + 1, on * tl.exp2(tl.minimum(r + S, 0.0 + FACTOR_MAX)), mask=j < Nk)


@triton.jit
def _tf32_split(a):
    """(hi, lo) with hi = a rounded down to TF32's 10-bit mantissa and lo = a - hi (exact): three
    TF32 products hi.hi + hi.lo + lo.hi give a float32-accurate product on the tensor cores (as
    Triton's tf32x3, without its per-element NaN select: the factors are finite)."""
    hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, a - hi


@triton.jit
def _grad_qk_kernel(X, Y, V, DO, GS, LSE, DELTA, FS, DGS, DFS, XF, UF, FAST, T, c, DQ, DK, MASK, H, Nx, Ny, D, DV, A,
                    sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                    L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, KT: tl.constexpr,
                    BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    CAP: tl.constexpr, CAP_L2: tl.constexpr, left=0, right=0, BAND: tl.constexpr = False,
                    CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
    """X = k (this program's keys), Y = q streamed (FlashAttention-2's backward layout). Per tile

        dL_yx = P_yx (dout_y . v_x - DELTA_y - sum_t [XF^t_y UF^t_x]) - sum_{t slow} (C^t dg^t + R^t df^t)_yx

    with P_yx = exp(A x.y + g^T_x - LSE_y). The bracket is one tensor-core product: the factor tiles
    (BLOCK_X, 2T + 1) x (2T + 1, BLOCK_Y), with DELTA as one more column (UF = 1 there), KT columns
    at a time, as three TF32 products of hi / lo parts (float32 accuracy), accumulated into
    dout . v's own product: no
    per-logit work for any term _factors_kernel could factor (FAST). The others (potentials too far
    apart for the factors, at tiny eps) take one exponential per logit as before: C^t and R^t share
    exp(A x.y + f^t_y + max(g^t - c, g^{t-1})_x) (<= 1) and differ by rho_x = exp(-|g^t - c - g^{t-1}|_x).
    Then DK_x = A (sum_y dL_yx q_y - [l2] k_x sum_y dL_yx) (in K's dtype) and DQ_y += sum_x dL_yx k_x
    over all key blocks (float32 atomics; the host multiplies by A). The l2 term of dq,
    -q_y sum_x dL_yx, is omitted: every row of dL sums to zero (the outputs do not change when a
    constant is added to a row of logits), while the column sums are the adjoint of g^0 = -a|k|^2
    and stay. With a softcap (CAP) dL is multiplied by the cap's slope first (the gradient of the
    uncapped logit -a|q - k|^2, whose rows no longer sum to zero: the dq term is kept, CAP_L2). Stacks: GS (T + 1, BH,
    Nx) = g^0..g^T, FS / DFS (T, BH, Ny), DGS (T, BH, Nx); factors
    XF (BH, Ny, 2T), UF (BH, Nx, 2T) and FAST (T, BH) from _factors_kernel (any tensors when T = 0)."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    c = tl.cast(c, tl.float32) * LOG2E
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    BH = tl.num_programs(1)
    if VARLEN:  # bh = sequence * H + head (see _lse_kernel, _factors_kernel); X = k
        sx, Nx, sy, Ny, cs, hx, hy = _packed_entry(CU_Q, CU_K, bh, H, False)
        if pid * BLOCK_X >= Nx:
            return
        c *= cs
        X += sx * D
        Y += sy * D
        V += sx * DV
        DO += sy * DV
        GS += sx + T * hx
        LSE += sy
        DELTA += sy
        FS += sy + (T - 1) * hy
        DGS += sx + (T - 1) * hx
        DFS += sy + (T - 1) * hy
        XF += sy * 2 * T
        UF += sx * 2 * T
        FAST += (bh // H) * H * (T - 1)
        DQ += sy * D
        DK += sx * D
        BH = H
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_x = offs_x < Nx
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    v = _load_rows(V + bh * Nx * DV, offs_x, Nx, offs_dv, DV)
    g = _load_vec(GS + (T * BH + bh) * Nx, offs_x, Nx, float("-inf")) * LOG2E
    UFh, XFh = UF + bh * Nx * 2 * T, XF + bh * Ny * 2 * T
    a2 = A * LOG2E
    dk = tl.zeros([BLOCK_X, BLOCK_D], tl.float32)
    colsum = tl.zeros([BLOCK_X], tl.float32)
    band = _band_span(pid * BLOCK_X, Nx, Ny, left, right, BAND, BLOCK_X, BLOCK_Y)
    for y0 in range(band[0], band[1], BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        in_y = offs_y < Ny
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        lse = _load_vec(LSE + bh * Ny, offs_y, Ny, float("inf")) * LOG2E
        t, slope = _scores(x, y, a2, UPCAST, PRECISION, CAP, CAP_L2)
        t = _apply_mask(t - lse[None, :], Mh, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND, MASK_SHAPE)
        t = _band_cut(t, y0, offs_x, offs_y, Nx, Ny, band, BAND, BLOCK_Y)
        delta = _load_vec(DELTA + bh * Ny, offs_y, Ny, 0.0)
        dp = tl.zeros([BLOCK_X, BLOCK_Y], tl.float32)
        for k0 in range(0, 2 * T + 1, KT):   # KT factor columns at a time: one round up to n_iters = 3
            offs_k = k0 + tl.arange(0, KT)
            # -(factor columns, then 1 for DELTA): the bracket's product is subtracted by accumulation
            uf = tl.load(UFh + offs_x[:, None] * 2 * T + offs_k[None, :],
                         mask=in_x[:, None] & (offs_k[None, :] < 2 * T), other=0.0)
            uf_hi, uf_lo = _tf32_split(-tl.where(offs_k[None, :] == 2 * T, 1.0, uf))
            xf = tl.load(XFh + offs_y[:, None] * 2 * T + offs_k[None, :],
                         mask=in_y[:, None] & (offs_k[None, :] < 2 * T), other=0.0)
            xf_hi, xf_lo = _tf32_split(tl.where(offs_k[None, :] == 2 * T, delta[:, None], xf))
            dp = tl.dot(uf_lo, tl.trans(xf_hi), dp, input_precision="tf32")
            dp = tl.dot(uf_hi, tl.trans(xf_lo), dp, input_precision="tf32")
            dp = tl.dot(uf_hi, tl.trans(xf_hi), dp, input_precision="tf32")
        do = _load_rows(DO + bh * Ny * DV, offs_y, Ny, offs_dv, DV)
        dp = mma(v, tl.trans(do), dp, UPCAST, PRECISION)      # dout . v - DELTA - factored terms
        dl = tl.exp2(t + g[:, None]) * dp
        for it in range(T):
            if tl.load(FAST + it * BH + bh) == 0:
                gr = _load_vec(GS + (it * BH + bh) * Nx, offs_x, Nx, 0.0) * LOG2E
                gc = _load_vec(GS + ((it + 1) * BH + bh) * Nx, offs_x, Nx, 0.0) * LOG2E - c
                dg = _load_vec(DGS + (it * BH + bh) * Nx, offs_x, Nx, 0.0)
                up = gc >= gr
                rho = tl.exp2(-tl.abs(gc - gr))
                hk = tl.where(in_x, tl.maximum(gc, gr), float("-inf"))
                # t holds -LSE_y: add it back (and keep -inf, not -inf + inf, past Ny)
                fq = tl.where(in_y, _load_vec(FS + (it * BH + bh) * Ny, offs_y, Ny, 0.0) * LOG2E + lse, float("-inf"))
                df = _load_vec(DFS + (it * BH + bh) * Ny, offs_y, Ny, 0.0)
                w = tl.where(up, dg, dg * rho)[:, None] + tl.where(up, rho, 1.0)[:, None] * df[None, :]
                dl -= tl.exp2(t + hk[:, None] + fq[None, :]) * w
        if CAP > 0:  # through the cap: the gradient of the uncapped logit
            dl = dl * slope
        dk += mm(dl.to(y.dtype), y, UPCAST, PRECISION)
        if L2:
            colsum += tl.sum(dl, 1)
        dq = mm(tl.trans(dl).to(x.dtype), x, UPCAST, PRECISION)
        if CAP_L2 and CAP > 0:  # capped rows of dl no longer sum to zero: dq's -q_y sum_x dL_yx term stays
            dq -= y.to(tl.float32) * tl.sum(dl, 0)[:, None]
        tl.atomic_add(DQ + bh * Ny * D + offs_y[:, None] * D + offs_d[None, :], dq,
                      mask=in_y[:, None] & (offs_d[None, :] < D), sem="relaxed")
    if L2:
        dk = A * (dk - x.to(tl.float32) * colsum[:, None])
    else:
        dk = A * dk
    tl.store(DK + bh * Nx * D + offs_x[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=(offs_x[:, None] < Nx) & (offs_d[None, :] < D))
