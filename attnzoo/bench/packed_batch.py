"""A fine-tuning batch of mixed lengths, padded or packed (padding-free), for the model benchmark's
``llama_padded`` / ``llama_packed`` rows and ``benchmarks/packed_llama.py``.

The lengths are fractions of the longest (``FRACTIONS``): with 8 sequences, half the tokens of the
padded (8, longest) batch are padding, the case packing is for. The padded batch is (B, longest)
with its attention mask and the padding left out of the loss; the packed one is the same sequences
back to back in one row with restarting position_ids plus the flash kwargs (cu_seq_lens_q/k,
max_length_q/k), what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` sends, and
``use_cache=False`` as in training. Both predict the same tokens: the first token of a packed sequence
is not a target (it would be predicted from the previous sequence), as in the padded rows.
"""
from __future__ import annotations

import torch

# sum = 4 of 8: half the padded tokens are padding (512 -> 512, 384, 320, 256, 192, 160, 128, 96)
FRACTIONS = (1.0, 0.75, 0.625, 0.5, 0.375, 0.3125, 0.25, 0.1875)

# the small Llama of the packed rows (grouped heads: 8 query heads share 4 key/value heads)
SMALL_LLAMA = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024,
               "attention_dropout": 0.0}


def mixed_lengths(batch: int, longest: int) -> list[int]:
    """``batch`` lengths, FRACTIONS of ``longest`` in turn (at least 2: one token is no target)."""
    return [max(2, round(longest * FRACTIONS[i % len(FRACTIONS)])) for i in range(batch)]


def sequences(lengths: list[int], vocab: int, g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def padded(seqs: list[torch.Tensor]) -> dict:
    """(B, longest) input_ids, attention_mask and labels (-100 on padding)."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def packed(seqs: list[torch.Tensor]) -> dict:
    """One row: input_ids, labels (-100 at each sequence's first token), restarting position_ids, the
    flash kwargs and use_cache=False."""
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    flat = torch.cat(seqs)[None]
    labels = flat.clone()
    labels[0, cu[:-1].long()] = -100
    return dict(input_ids=flat, labels=labels, position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
                use_cache=False)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
