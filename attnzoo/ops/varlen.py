"""Packed (variable-length) attention for every variant: ``torch.nn.attention.varlen.varlen_attn``'s
layout, each sequence its own attention problem.

q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) hold N sequences back to back; ``cu_seq_q`` and
``cu_seq_k`` (1-D integer tensors of N + 1 offsets, first 0, last T) say where each starts; ``max_q``
and ``max_k`` (Python ints) bound the lengths. Sequence i's output is the variant's own answer on
q[cu_seq_q[i]:cu_seq_q[i+1]] and its keys alone, so everything a variant normalises per problem is
per sequence: Sinkhorn's and OT's marginals, relu's 1/n, sigmoid's -log n, Fenchel's context
preference, linear attention's sums and causal prefixes. ``is_causal`` is bottom-right aligned inside
each sequence (key j for query i iff j <= i + n_k - n_q), as everywhere in attnzoo, and so is a
``window_size`` band; ``softcap`` and ``sinks`` apply to every sequence's rows.

A call whose variant has a varlen Triton form (softmax, l2, fenchel first order, sigmoid, relu, linear,
sinkhorn, ot) and that asks
for the "triton" backend, or "auto" on CUDA, runs the varlen kernels: one launch per kernel for all sequences,
each program reading its sequence's start and length from the offsets (``varlen_triton`` says when; it
never reads the offsets on the host, so it is the same route eager and under torch.compile). Otherwise
two exact routes, chosen once per call by how the call runs:

* eager: the offsets are read once on the host. On CPU, a variant with a blockwise form (softmax, l2,
  fenchel, sigmoid, relu) runs all sequences in one blockwise call that visits only the (query block,
  key block) pairs inside a sequence (``varlen_blockwise``, which says when); otherwise the sequences
  of equal (n_q, n_k) are stacked into one batch and handed to the variant's own function (so every
  backend of every variant runs packed calls). Either way the work is the sum over sequences of
  n_q n_k, never T_q T_k;
* while torch.compile traces: offsets cannot be read, so variants whose queries are independent of
  each other (every built-in one except Sinkhorn) run as one padded batch of N rows of max_q / max_k
  with a per-sequence key mask (``padded``): masking a key is removing it in every attnzoo variant and
  padded queries are dropped, so it is exact. A variant that couples queries (``couples_queries``:
  Sinkhorn) runs as one padded batch too (``padded_coupled``): each sequence placed so that the variant's
  own bottom-right causal diagonal and window band are the sequence's, its padded queries and keys
  masked out entirely, which drops them from the problem (masking.coupled_causal_rows); so
  torch.compile(fullgraph=True) holds for every variant.
"""
from __future__ import annotations

import numbers
import weakref

import torch

from . import logit_extras
from . import validate as V
from . import variant as catalog
from . import varlen_blockwise, varlen_triton
from .varlen_options import per_key_options


# per argument, the offsets read last: (weak reference to the tensor, its version, total, max, offsets).
# Every layer of a packed forward gets the same offsets tensor: read (a host sync on a GPU) and checked
# once, not once per layer; an in-place change of the tensor bumps its version and reads it again.
_LAST_READ: dict = {}


def _check_offsets(name: str, cu, total: int, max_len, max_name: str, device, read_values: bool) -> list[int] | None:
    """Checks ``name`` (N + 1 offsets into a packed dim of ``total`` tokens) and returns the offsets as
    ints (None when values are not read: under torch.compile)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch.Tensor of N + 1 offsets, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with N + 1 >= 2 offsets (N sequences), got shape {tuple(cu.shape)}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must hold int32 (or int64) offsets, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len < 1:
        raise ValueError(f"{max_name} must be a Python int >= 1 (the longest sequence), got {max_len!r}")
    if not read_values:
        _assert_on_device(name, cu, total, max_len, max_name)
        return None
    last = _LAST_READ.get(name)
    if last is not None and last[0]() is cu and last[1:4] == (cu._version, total, max_len):
        return last[4]
    offsets = cu.tolist()
    if offsets[0] != 0 or offsets[-1] != total or any(not 0 <= o <= total for o in offsets):
        raise ValueError(f"{name} must run from 0 to the packed length {total} within [0, {total}], got {offsets}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be sorted (non-decreasing offsets), got {offsets}")
    if 0 in lengths:
        raise ValueError(f"{name} gives sequence {lengths.index(0)} length 0 (offsets {offsets}); every packed "
                         "sequence needs at least one token")
    if max(lengths) > max_len:
        raise ValueError(f"{max_name}={max_len} is shorter than the longest sequence in {name} ({max(lengths)})")
    _LAST_READ[name] = (weakref.ref(cu), cu._version, total, max_len, offsets)
    return offsets


def _assert_on_device(name: str, cu, total: int, max_len: int, max_name: str) -> None:
    """While torch.compile traces, the offsets' values cannot be read on the host: the checks
    ``_check_offsets`` makes eagerly become asserts in the graph (torch._assert_async: raised on CPU at
    the call, a device-side assert on CUDA), so malformed offsets never give a silent answer."""
    lengths = cu[1:] - cu[:-1]
    torch._assert_async((cu[0] == 0) & (cu[-1] == total),
                        f"{name} must run from 0 to the packed length {total}")
    torch._assert_async((lengths >= 1).all(),
                        f"{name} must be sorted, every sequence at least one token long")
    torch._assert_async((lengths <= max_len).all(),
                        f"{max_name}={max_len} is shorter than the longest sequence in {name}")


def _check_packed(q, k, v) -> None:
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"packed {arg} must have shape (T, H, D) (3 dims), got {t.dim()} dims {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"packed k and v must hold the same tokens (dim 0), got k {tuple(k.shape)}, v {tuple(v.shape)}")


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    """(G, n, H, D) -> (G, H, n, D)."""
    return t.transpose(1, 2)


def per_sequence(fn, q, k, v, offsets_q, offsets_k, kwargs, key_tokens=None) -> torch.Tensor:
    """Sequences of equal (n_q, n_k) stacked into one (G, H, n, D) batch each, the outputs put back in
    packed order. ``key_tokens`` (T_k, dim): what a layer reads beside its keys (Fenchel's context),
    handed to ``fn`` as ``x`` (G, n_k, dim). An option given per key token (``varlen_options.PerKey``)
    reaches ``fn`` as its sequences' rows, (G, H, 1, n_k)."""
    per_key = per_key_options(kwargs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (a, b, c, d) in enumerate(zip(offsets_q, offsets_q[1:], offsets_k, offsets_k[1:])):
        groups.setdefault((b - a, d - c), []).append(i)
    outputs: list = [None] * (len(offsets_q) - 1)
    for members in groups.values():
        def stack(t, offs):
            return torch.stack([t[offs[i]:offs[i + 1]] for i in members])
        extra = {} if key_tokens is None else {"x": stack(key_tokens, offsets_k)}
        extra.update({name: value.stacked(offsets_k, members) for name, value in per_key.items()})
        out = fn(_as_batch(stack(q, offsets_q)), _as_batch(stack(k, offsets_k)), _as_batch(stack(v, offsets_k)),
                 **{**kwargs, **extra})                                # (G, H, n_q, Dv)
        for i, o in zip(members, out.transpose(1, 2).unbind(0)):
            outputs[i] = o
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


@torch.compiler.disable
def per_sequence_reading_offsets(fn, q, k, v, cu_seq_q, cu_seq_k, kwargs, key_tokens=None) -> torch.Tensor:
    """``per_sequence`` where the offsets are still tensors (torch.compile is tracing): read here, outside
    the graph (a graph break; refused under fullgraph=True)."""
    return per_sequence(fn, q, k, v, cu_seq_q.tolist(), cu_seq_k.tolist(), kwargs, key_tokens)


def _token_index(cu: torch.Tensor, total: int):
    """(sequence, position in it) of every packed token, from the offsets, with no host read."""
    token = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:].to(torch.int64), token, right=True)
    return seq, token - cu.to(torch.int64)[seq]


def _pad(t: torch.Tensor, seq, slot, n_seq: int, length: int) -> torch.Tensor:
    """Packed (T, ...) -> (N, length, ...): token t at (seq[t], slot[t]), zeros elsewhere."""
    return t.new_zeros((n_seq, length) + t.shape[1:]).index_put((seq, slot), t)


def padded(fn, q, k, v, cu_q, cu_k, max_q, max_k, is_causal, kwargs) -> torch.Tensor:
    """One (N, H, max, D) batch with each sequence's keys kept by a mask; padded queries dropped. The
    causal diagonal and a ``window_size`` band are aligned bottom-right inside each sequence here, in the
    mask (handed to ``fn`` they would align to the padded max_q x max_k block)."""
    kwargs = dict(kwargs)
    window = logit_extras.check_window_size(kwargs.pop("window_size", None))
    n_seq = cu_q.numel() - 1
    seq_q, pos_q = _token_index(cu_q, q.shape[0])
    seq_k, pos_k = _token_index(cu_k, k.shape[0])

    len_q = (cu_q[1:] - cu_q[:-1]).to(torch.int64)[:, None, None]
    len_k = (cu_k[1:] - cu_k[:-1]).to(torch.int64)[:, None, None]
    key = torch.arange(max_k, device=q.device)[None, None, :]
    keep = key < len_k                                                  # (N, 1, max_k)
    query = torch.arange(max_q, device=q.device)[None, :, None]
    diagonal = key - query - (len_k - len_q)                            # (N, max_q, max_k): j - i - (n_k - n_q)
    if is_causal:
        keep = keep & (diagonal <= 0)
    if window is not None and window[0] >= 0:
        keep = keep & (diagonal >= -window[0])
    if window is not None and window[1] >= 0:
        keep = keep & (diagonal <= window[1])
    kwargs.update({name: value.padded(seq_k, pos_k, n_seq, max_k) for name, value in per_key_options(kwargs).items()})
    out = fn(_as_batch(_pad(q, seq_q, pos_q, n_seq, max_q)), _as_batch(_pad(k, seq_k, pos_k, n_seq, max_k)),
             _as_batch(_pad(v, seq_k, pos_k, n_seq, max_k)), attn_mask=keep[:, None], **kwargs)
    return out.transpose(1, 2)[seq_q, pos_q]


def padded_coupled(fn, q, k, v, cu_q, cu_k, max_q, max_k, is_causal, kwargs) -> torch.Tensor:
    """For a variant that couples queries (Sinkhorn): one padded (N, H, ., D) batch in which every sequence
    is its own problem, ``is_causal`` and a ``window_size`` band handed to ``fn`` as they are (a coupled
    variant's causal call is its prefix rule, not a causal mask).

    Layout: sequence s's queries at rows 0 .. n_q - 1 of a block of max_q, its keys at columns
    P .. P + n_k - 1 of a block of W, P = W - max_q - (n_k - n_q). Then ``fn``'s bottom-right alignment on
    the max_q x W block is each sequence's own (j' - i' - (W - max_q) = j - i - (n_k - n_q)), and no key
    of the sequence without a query of its own (the first n_k - n_q, when n_k > n_q) gets a padded query
    in its place, which the causal rule would pair with later tokens (masking.causal_completion): P >= 0
    for every sequence needs W >= max_q + n_k - n_q, so W = max_q + max_k - 1 in general and W = max_q
    for self-attention (the same offsets tensor for queries and keys, P = 0); a non-causal call without a
    window aligns nothing (W = max_k, P = 0). The padded queries and keys are masked out entirely, so
    they drop out of every problem (a fully masked row or column takes no part in a Sinkhorn problem; the
    one thing the padded size still changes, the column target log(max_q / W), shifts every key potential
    of a problem alike, which the final row normalisation removes). Padded queries' rows are dropped."""
    n_seq = cu_q.numel() - 1
    seq_q, pos_q = _token_index(cu_q, q.shape[0])
    seq_k, pos_k = _token_index(cu_k, k.shape[0])
    len_q = (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    len_k = (cu_k[1:] - cu_k[:-1]).to(torch.int64)
    window = logit_extras.check_window_size(kwargs.get("window_size"))
    if not is_causal and window is None:        # nothing aligned: every sequence's keys from column 0
        width, first_key = max_k, torch.zeros_like(len_k)
    else:
        width = max_q if cu_k is cu_q and max_k == max_q else max_q + max_k - 1
        first_key = width - max_q - (len_k - len_q)                                      # P, per sequence
    slot_k = pos_k + first_key[seq_k]

    real_q = torch.arange(max_q, device=q.device)[None, :] < len_q[:, None]                # (N, max_q)
    column = torch.arange(width, device=q.device)[None, :]
    real_k = (column >= first_key[:, None]) & (column < (first_key + len_k)[:, None])      # (N, W)
    keep = real_q[:, None, :, None] & real_k[:, None, None, :]                            # (N, 1, max_q, W)
    kwargs = dict(kwargs)
    kwargs.update({name: value.padded(seq_k, slot_k, n_seq, width) for name, value in per_key_options(kwargs).items()})
    out = fn(_as_batch(_pad(q, seq_q, pos_q, n_seq, max_q)), _as_batch(_pad(k, seq_k, slot_k, n_seq, width)),
             _as_batch(_pad(v, seq_k, slot_k, n_seq, width)), attn_mask=keep, is_causal=is_causal, **kwargs)
    return out.transpose(1, 2)[seq_q, pos_q]


def check(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k):
    """The packed layout's checks -> (cu_seq_k, max_k, offsets_q, offsets_k): ``cu_seq_k=None`` means
    q's offsets; the offsets are read as ints in eager mode (None while torch.compile traces)."""
    _check_packed(q, k, v)
    if cu_seq_k is None:
        cu_seq_k, max_k = cu_seq_q, (max_q if max_k is None else max_k)
    read = not torch.compiler.is_compiling()
    offsets_q = _check_offsets("cu_seq_q", cu_seq_q, q.shape[0], max_q, "max_q", q.device, read)
    offsets_k = _check_offsets("cu_seq_k", cu_seq_k, k.shape[0], max_k, "max_k", q.device, read)
    if cu_seq_q.numel() != cu_seq_k.numel():
        raise ValueError(f"cu_seq_q and cu_seq_k must give the same number of sequences, got "
                         f"{cu_seq_q.numel() - 1} and {cu_seq_k.numel() - 1}")
    return cu_seq_k, max_k, offsets_q, offsets_k


def attend_varlen(name: str, q, k, v, cu_seq_q, cu_seq_k=None, max_q=None, max_k=None, *, is_causal=False,
                  scale=None, dropout_p=0.0, backend=None, enable_gqa=False, **options) -> torch.Tensor:
    """Variant ``name`` on packed q (T_q, H, D), k, v (T_k, H_kv, D / Dv) -> (T_q, H, Dv); see the module."""
    V.check_choice("variant", name, catalog.names())
    record = catalog.get(name)
    cu_seq_k, max_k, offsets_q, offsets_k = check(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k)
    for option, value in per_key_options(options).items():
        value.check(option, k.shape[0], q.shape[1])
    kwargs = dict(scale=scale, dropout_p=dropout_p, backend=backend, enable_gqa=enable_gqa, **options)
    out = varlen_triton.run(name, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, kwargs)  # Triton: one launch
    if out is not None:                                                 # per kernel, offsets read in the kernels
        return out
    if offsets_q is None and not record.couples_queries:               # torch.compile is tracing
        return padded(record.functional, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k,
                      V.check_flag("is_causal", is_causal), kwargs)
    if offsets_q is None:                                               # compiling a coupling variant
        return padded_coupled(record.functional, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k,
                              V.check_flag("is_causal", is_causal), kwargs)
    out = varlen_blockwise.run(name, q, k, v, offsets_q, offsets_k, is_causal, kwargs)   # CPU: one blockwise call
    if out is not None:
        return out
    return per_sequence(record.functional, q, k, v, offsets_q, offsets_k, dict(is_causal=is_causal, **kwargs))
