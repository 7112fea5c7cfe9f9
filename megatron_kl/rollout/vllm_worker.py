"""vLLM worker extension (``worker_extension_cls``): weight loading called through ``collective_rpc``.

Runs inside vLLM's worker processes; ``self`` is the worker, ``self.model_runner.model`` the model whose
``load_weights`` takes ``(hf_name, tensor)`` pairs (with tied embeddings vLLM still expects
``lm_head.weight`` in the set).
"""

from __future__ import annotations


class WeightUpdateExtension:
    def load_named_weights(self, named: list) -> int:
        """Load HF-named tensors sent with the RPC (in-process engine: the tensors are pickled across)."""
        self.model_runner.model.load_weights(weights=named)
        return len(named)

    def load_weights_from_path(self, path: str) -> int:
        """Load an HF checkpoint directory written by the trainer (server mode: a path fits in JSON)."""
        from megatron_kl.models.hf import HFCheckpoint

        checkpoint = HFCheckpoint(path)
        named = [(name, checkpoint.get(name)) for name in checkpoint.files]
        if "lm_head.weight" not in checkpoint.files and "model.embed_tokens.weight" in checkpoint.files:
            named.append(("lm_head.weight", checkpoint.get("model.embed_tokens.weight")))
        self.model_runner.model.load_weights(weights=named)
        return len(named)
