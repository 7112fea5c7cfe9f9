"""Token layout of prompt + response sequences for the trainer.

``pack(prompts, responses)`` right-pads ``prompt + response`` rows into ``tokens [B, S]`` and builds
``loss_mask [B, S-1]`` (1 where ``tokens[:, t+1]`` is a response token), and scatters per-response-token
values (behaviour log-probs) into the same ``[B, S-1]`` alignment.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_kl.models.routing_replay import UNKNOWN


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    per_token: Optional[Sequence[Sequence[float]]] = None,
    length: Optional[int] = None,
):
    """Returns tokens [B, S] (long), loss_mask [B, S-1] (float) and, if given, per_token [B, S-1]."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    length = max(longest, 2) if length is None else length
    if length < longest:
        raise ValueError(f"length={length} is shorter than the longest sequence ({longest})")
    batch = len(prompts)
    tokens = torch.full((batch, length), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, length - 1)
    values = torch.zeros(batch, length - 1) if per_token is not None else None
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        tokens[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        lo, hi = len(p) - 1, len(p) - 1 + len(r)
        mask[i, lo:hi] = 1.0
        if values is not None:
            values[i, lo:hi] = torch.as_tensor(list(per_token[i]), dtype=torch.float32)
    return tokens, mask, values


def pack_routing(routings: Sequence[Optional[torch.Tensor]], length: int) -> Optional[torch.Tensor]:
    """Per-row expert ids ``[n_i, L, k]`` (a row's first n_i input positions) as ``[B, length, L, k]``, UNKNOWN at
    positions no engine routed (a row's last token, padding); None unless every row has them."""
    if not routings or any(r is None for r in routings):
        return None
    first = routings[0]
    out = torch.full((len(routings), length, *first.shape[1:]), UNKNOWN, dtype=torch.int16)
    for i, ids in enumerate(routings):
        out[i, : ids.shape[0]] = torch.as_tensor(ids).to(torch.int16)
    return out
