"""What a cached decode step needs beyond the host's KV cache, kept on the host's attention module.

A KV cache keeps the keys and values of the earlier positions. That is all a row-wise variant needs
for the next token, but not all that two kinds of kernel read:

* a variant that couples queries (``couples_queries``: Sinkhorn). Causal attention is the variant run
  on every prefix (paper 002 eq 2.6), so the row of position i is the last row of the Sinkhorn
  problem over the queries of positions 0..i. Alone, the new query is a 1-row problem, whose plan is
  uniform (the plain mean of the values): a different answer. The decode step needs the earlier
  positions' queries;
* a kernel that reads the key tokens (``needs_key_tokens``: Fenchel's context preference computes
  log u_j from token j), which needs the earlier positions' tokens.

``extend`` keeps them (``PrefixState``, per module) and hands back those of every position of the call. A call
with no earlier position (a prompt, or a forward without a cache) starts a sequence. A call with P
earlier positions first checks that what is kept belongs to this sequence: the keys the host's cache
now holds for positions 0..P-1 (``ident``) must equal, bit for bit, those seen when they were kept.
Rows are matched one by one, so a beam search's ``reorder_cache`` and a batch selection are followed,
and a cropped cache (assisted decoding) uses the first P kept positions. A padding mask must still
mark the same earlier positions as padding.

Under a sliding window (``window=True``: the host's attention has one, e.g. HF's ``sliding_window``)
the host may drop old positions in two ways, both followed: its mask stops keeping the keys that left
the window (so the mask may keep fewer earlier positions than were kept, never one that was padding),
and a sliding cache (transformers' ``DynamicSlidingWindowLayer``) holds only the last positions, so its
P earlier keys are the LAST P kept positions; what is kept then shrinks with the cache.
Anything else raises ValueError saying why and what to pass instead: never a silent other answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import weakref

import torch
from torch import nn

# host attention module -> its PrefixState; weak keys: the state goes with the module, and never into
# a pickled model or its state_dict
_STATES: "weakref.WeakKeyDictionary[nn.Module, PrefixState]" = weakref.WeakKeyDictionary()

ADVICE = ("pass use_cache=False (every position is then recomputed from the tokens), or start the "
          "sequence again from its first token")


@dataclass
class PrefixState:
    """Positions 0..L-1 of each batch row: their identifying keys and padding, and what the kernel reads."""
    ident: torch.Tensor                    # (B, ..., L, d): the keys these positions were attended with
    keep: Optional[torch.Tensor]           # (B, Hm, L) bool, False = padding; None: no padding
    queries: Optional[torch.Tensor]        # (B, H, L, D)
    tokens: Optional[torch.Tensor]         # (B, L, dim)

    @property
    def length(self) -> int:
        return self.ident.shape[-2]


def forget(module: nn.Module) -> None:
    _STATES.pop(module, None)


def _match_rows(now: torch.Tensor, kept: torch.Tensor):
    """For each row b of ``now`` (B, ...), the index of a row of ``kept`` equal to it bit for bit:
    ``"same"`` when the rows are the kept ones in order, None when some row matches none."""
    if now.shape[1:] != kept.shape[1:] or now.dtype != kept.dtype or now.device != kept.device:
        return None
    if now.shape[0] == kept.shape[0] and torch.equal(now, kept):
        return "same"
    flat_now, flat_kept = now.flatten(1), kept.flatten(1)
    rows = []
    for b in range(flat_now.shape[0]):
        hits = (flat_kept == flat_now[b]).all(1).nonzero()
        if hits.numel() == 0:
            return None
        rows.append(hits[0, 0])
    return torch.stack(rows) if rows else torch.zeros(0, dtype=torch.long, device=now.device)


def _same_padding(before: Optional[torch.Tensor], now: Optional[torch.Tensor], past: int) -> bool:
    """The first ``past`` positions are padding in ``before`` exactly where they are in ``now`` (None: none)."""
    if before is None or now is None:
        other = now if before is None else before
        return other is None or bool(other[..., :past].all())
    before, now = before[..., :past], now[..., :past]
    if before.shape[0] != now.shape[0] or before.device != now.device:
        return False
    return bool((before == now).all())


def _slice(t: Optional[torch.Tensor], shift: int, past: int) -> Optional[torch.Tensor]:
    """Kept positions shift..shift+past-1 of a (B, ..., L) tensor (None stays None)."""
    return None if t is None else t[..., shift:shift + past]


def _rows(t: Optional[torch.Tensor], rows) -> Optional[torch.Tensor]:
    if t is None or isinstance(rows, str):
        return t
    return t.index_select(0, rows.to(t.device))


def _fewer_kept(before: Optional[torch.Tensor], now: Optional[torch.Tensor], past: int) -> bool:
    """Under a sliding window: no earlier position the mask keeps ``now`` was padding ``before``."""
    if before is None or now is None:
        return True
    before, now = before[..., :past], now[..., :past]
    if before.shape[0] != now.shape[0] or before.device != now.device:
        return False
    return not bool((now & ~before).any())


def _shifts(state: PrefixState, past: int, window: bool):
    """Where the call's ``past`` earlier positions start among the kept ones: at 0 (the cache holds every
    position, or a cropped cache its first ones); under a sliding window also at the end (a sliding
    cache holds the last ones)."""
    shifts = [0]
    if window and state.length > past:
        shifts.append(state.length - past)
    return shifts


def _kept_prefix(state: Optional[PrefixState], ident: torch.Tensor, keep: Optional[torch.Tensor], past: int,
                 what: str, window: bool = False) -> tuple[PrefixState, object, int]:
    """The kept state, its row order and the kept position of the call's first earlier position
    (``_shifts``), for this call's ``past`` earlier positions, or ValueError."""
    if state is None:
        reason = ("nothing is kept for them: the sequence did not start through this layer in this mode "
                  "(its first call ran in training mode with gradients on, or with a mask that is not "
                  "causal + padding (+ the host's sliding window), e.g. a position bias or a static cache, or "
                  "it was a packed row of several sequences, whose per-sequence state nothing keeps)")
    elif state.length < past:
        reason = f"only {state.length} are kept (the cache holds more positions than went through this layer)"
    else:
        found = None
        for shift in _shifts(state, past, window):
            rows = _match_rows(ident[..., :past, :], state.ident[..., shift:shift + past, :])
            if rows is not None:
                found = rows, shift
                break
        if found is None:
            reason = ("the keys the cache holds for them are not those the kept queries were seen with "
                      "(another sequence, a cache changed in place, a quantised cache, or a cache that "
                      "drops old positions without a sliding window)")
        else:
            rows, shift = found
            before = _slice(_rows(state.keep, rows), shift, past)
            if not (_fewer_kept if window else _same_padding)(before, keep, past):
                reason = ("the mask now marks a different set of them as padding (a changed "
                          "attention_mask)")
            else:
                return state, rows, shift
    raise ValueError(f"{what}: a cached step with {past} earlier position(s) needs their queries "
                     f"(the variant couples queries) or tokens, but {reason}; {ADVICE}")


def extend(module: nn.Module, *, ident: torch.Tensor, new: int, what: str,
           queries: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None,
           keep: Optional[torch.Tensor] = None, remember: bool = True, window: bool = False
           ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The queries (B, H, P + new, D) and tokens (B, P + new, dim) of every position of this call.

    ``ident``: (B, ..., P + new, d), the keys identifying all positions (the cache's keys after this
    call's update); ``queries`` / ``tokens``: the call's own ``new`` positions (None: not needed);
    ``keep``: (B, Hm, P + new) bool padding of every position (None: none); under ``window`` the
    positions the call's mask keeps, its earlier ones maybe fewer than were kept (see the module's
    docstring), and what is kept for them is the padding they were first kept with. ``remember=False``
    (training with gradients on, or a mask the kept state cannot follow) forgets the state instead of
    keeping it, so no activation outlives its step."""
    past = ident.shape[-2] - new
    if past < 0:
        raise ValueError(f"{what}: {new} new positions but only {ident.shape[-2]} keys")
    state = _STATES.get(module)
    if past > 0:
        state, rows, shift = _kept_prefix(state, ident, keep, past, what, window)
        if queries is not None:
            if state.queries is None:
                raise ValueError(f"{what}: no queries are kept for the earlier positions; {ADVICE}")
            queries = torch.cat([_rows(state.queries, rows)[..., shift:shift + past, :], queries], dim=-2)
        if tokens is not None:
            if state.tokens is None:
                raise ValueError(f"{what}: no key tokens are kept for the earlier positions; {ADVICE}")
            tokens = torch.cat([_rows(state.tokens, rows)[:, shift:shift + past], tokens], dim=1)
        if window and keep is not None:
            # the earlier positions keep the padding they were kept with (the mask may now drop them)
            before = _slice(_rows(state.keep, rows), shift, past)
            if before is None:
                before = torch.ones_like(keep[..., :past])
            keep = torch.cat([before, keep[..., past:]], dim=-1)
    if remember:
        # a copy of the keys: a cache that updates its tensors in place must not fool the check
        _STATES[module] = PrefixState(ident=ident.detach().clone(), keep=keep,
                                                  queries=queries, tokens=tokens)
    else:
        forget(module)
    return queries, tokens
