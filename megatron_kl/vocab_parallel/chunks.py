"""What the vocab-parallel kernel steps take, by name: one pass's shared settings (:class:`Sweep`), a chunk of rows
(:class:`Rows`), the upstream gradients (:class:`Upstream`) and what a forward keeps for the gradient of the same
pass (:class:`Kept`). The steps (``vocab_parallel.chunk_forward`` / ``chunk_grad`` and their Triton twins in
``triton_stats``) take these instead of a dozen positional arguments and mode flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

# rows of the per-position state a forward returns and the gradient reads (``norms [5, n]``): the policy's maximum
# logit M, the shift M - M_r to the reference's, S = sum_a exp((x_a - M) / tau), E_pi[zc], E_pi[u]
MAX, SHIFT, SUM, MEAN_ZC, MEAN_U = range(5)


@dataclass(frozen=True)
class Shard:
    """Where this rank's slice sits in the global vocabulary and how much of it is real."""

    start: int  # global index of the first local column
    valid: int  # local columns below vocab_size (the rest is padding)

    def owned(self, targets: torch.Tensor):
        """(local column of each target, whether this rank holds it)."""
        local = targets - self.start
        return local, (local >= 0) & (local < self.valid)


class Workspace:
    """Chunk temporaries reused from chunk to chunk: one allocation per name for a whole loop. On CPU a
    fresh large allocation is page-faulted on every use (~1 GB/s; glibc maps blocks over 32 MiB anew each
    time), which costs more than the arithmetic on it."""

    def __init__(self):
        self._buffers: dict = {}

    def get(self, name: str, rows: int, cols: int, dtype, device) -> torch.Tensor:
        numel = rows * cols
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(rows, cols)

    def like(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.get(name, tensor.shape[0], tensor.shape[1], tensor.dtype, tensor.device)


@dataclass(frozen=True)
class Sweep:
    """One pass over the chunks of a batch of rows: this rank's vocabulary ``shard``, the TP ``group``, the
    temperature tau, whether the entropy is wanted, whether the inputs may be overwritten (``scratch``), and the
    temporaries reused from chunk to chunk."""

    shard: Shard
    group: object
    temperature: float
    entropy: bool = True
    scratch: bool = False
    workspace: Workspace = field(default_factory=Workspace, compare=False)


def cut(value: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    """Rows ``rows`` of an optional per-row tensor."""
    return None if value is None else value[rows]


@dataclass(frozen=True)
class Rows:
    """A chunk of ``n`` rows: this rank's valid columns of the policy logits ``x [n, valid]`` (None where a
    ``Kept`` stands in) and of the reference's ``y`` (None: no KL), not divided by tau; the global ``targets [n]``
    (None: no log-prob); with a truncated policy its ``threshold [n]`` (the support is ``{x >= threshold}``) and
    each row's largest logit over all ranks where the caller knows it (``row_max [n]``)."""

    x: Optional[torch.Tensor]
    y: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None
    threshold: Optional[torch.Tensor] = None
    row_max: Optional[torch.Tensor] = None

    def __getitem__(self, rows: slice) -> "Rows":
        return Rows(*(cut(getattr(self, f.name), rows) for f in dataclasses.fields(self)))


@dataclass(frozen=True)
class Upstream:
    """dL/d(log-prob), dL/dH, dL/dKL per row ``[n]`` (None: the loss does not use that statistic)."""

    logprob: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    kl: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, grads, lo: int, hi: int, dtype) -> "Upstream":
        """Rows ``lo:hi`` of full-length gradients ``(log-prob, entropy, KL)``, in ``dtype``."""
        return cls(*(None if g is None else g[lo:hi].to(dtype) for g in grads))

    def __getitem__(self, rows: slice) -> "Upstream":
        return Upstream(cut(self.logprob, rows), cut(self.entropy, rows), cut(self.kl, rows))


@dataclass
class Kept:
    """What ``chunk_forward(keep=...)`` leaves for the gradient of the same chunk: ``zc`` and ``neg_u`` (= -u; [n,
    valid], compute dtype, in the inputs' buffers) and ``e`` = exp(zc) (a workspace buffer, valid until its next
    use); on the Triton path only the forward's ``rows`` (the gradient reads the logits again)."""

    zc: Optional[torch.Tensor] = None
    e: Optional[torch.Tensor] = None
    neg_u: Optional[torch.Tensor] = None
    rows: Optional[Rows] = None  # the Triton path

    def __getitem__(self, rows: slice) -> "Kept":
        return Kept(cut(self.zc, rows), cut(self.e, rows), cut(self.neg_u, rows))
