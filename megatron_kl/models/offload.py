"""Keep the frozen reference's weights in (pinned) host memory between uses (``parallel.offload_reference``).

``ReferenceOffload.resident()`` moves every parameter and buffer of the reference chunks to the
accelerator for the duration of a pass and back to the host afterwards, so between reference passes the
accelerator holds only the policy, its gradients and optimizer state. Without CUDA it is a no-op (the
weights already live in host memory).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class ReferenceOffload:
    def __init__(self, chunks: list, enabled: bool):
        self.chunks = chunks
        self.enabled = enabled and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.enabled else torch.device("cpu")
        if self.enabled:
            self._move(torch.device("cpu"), pin=True)

    def _tensors(self):
        for chunk in self.chunks:
            yield from chunk.parameters()
            yield from chunk.buffers()

    def _move(self, device: torch.device, pin: bool = False) -> None:
        for tensor in self._tensors():
            data = tensor.data.to(device, non_blocking=True)
            tensor.data = data.pin_memory() if pin and device.type == "cpu" else data
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    @property
    def on_host(self) -> bool:
        return all(t.device.type == "cpu" for t in self._tensors())

    @contextmanager
    def resident(self):
        if not self.enabled:
            yield
            return
        self._move(self.device)
        try:
            yield
        finally:
            self._move(torch.device("cpu"), pin=True)
