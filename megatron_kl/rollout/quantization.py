"""FP8 rollouts (``rollout.quantization: fp8``): the block-wise float8_e4m3 weights a rollout engine samples with.

The linear layers' weights (attention QKV and output projection, MLP and expert fc1 / fc2) are quantized in blocks of
128 x 128 - the layout of DeepSeek-V3's FP8 checkpoints and of SGLang's and vLLM's block-wise FP8 linear layers:

    s_b = max_{ij in b} |W_ij| / 448,    Q(W)_ij = s_b * e4m3(W_ij / s_b)

(e4m3: ``torch.float8_e4m3fn``, round to nearest even; 448 its largest finite value, so no block saturates; a block
of zeros keeps scale 1 and stays zero). Embeddings, norms, biases and the output layer keep the model's dtype, as
the FP8 serving engines keep them. The embedded engine holds Q(W) dequantized in the model's dtype after every
weight sync, so it samples from exactly the FP8 weights' policy; activations are not quantized (an FP8 GEMM engine
also quantizes them per token and 128 channels at run time: a further difference it does not simulate). With
tensor parallelism each rank quantizes its own shard (as a sharded FP8 server does). The trainer keeps its own
weights; the behaviour log-probs are the FP8 policy's, the mismatch metrics show the gap, and the behaviour
corrections (``algo.behavior_correction``, ``kl.off_policy=behavior``) correct for it like any other mu != pi_old.

SGLang servers are started with ``--quantization fp8`` (given ``rollout.sglang.urls`` must report it in
``/get_server_info``), vLLM's in-process engine with ``quantization="fp8"``.
"""

from __future__ import annotations

import re

from megatron_kl.rollout.config import QUANTIZATIONS  # noqa: F401 - the config's names, re-exported

BLOCK = 128
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# the linear layers' weights in megatron-core's GPTModel names (dense and expert MLPs)
QUANTIZED = re.compile(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight\d*$")


def quantized_name(name: str) -> bool:
    """Whether a GPTModel parameter is one of the weights FP8 serving quantizes."""
    return QUANTIZED.search(name) is not None


def block_fp8(weight, block: int = BLOCK):
    """Q(W): a 2-D ``weight`` quantized to e4m3 in ``block`` x ``block`` tiles with one float32 scale per tile
    (max |W| / 448 over the tile), returned dequantized in the weight's dtype and shape."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"block-wise FP8 quantizes matrices; got a tensor of shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    pad_r, pad_c = (-rows) % block, (-cols) % block
    w = torch.nn.functional.pad(weight.detach().float(), (0, pad_c, 0, pad_r))
    tiles = w.view(w.shape[0] // block, block, w.shape[1] // block, block)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    dequantized = (tiles / scale).to(torch.float8_e4m3fn).float() * scale
    return dequantized.view(w.shape)[:rows, :cols].to(weight.dtype)


def quantize_model_(model) -> int:
    """Replace every quantized weight of ``model`` (megatron names) by Q(W) in place; returns how many."""
    import torch

    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if quantized_name(name) and param.dim() == 2:
                param.copy_(block_fp8(param))
                count += 1
    if count == 0:
        raise ValueError(
            "rollout.quantization=fp8 found no linear-layer weights (linear_qkv / linear_proj / "
            "linear_fc1 / linear_fc2) to quantize in the engine's model"
        )
    return count


def check_served_quantization(reported, wanted: str, where: str) -> None:
    """A given server's quantization (``/get_server_info``'s ``quantization``) against ``rollout.quantization``:
    a server that does not sample with the weights the run declares is refused, naming the field."""
    served = (
        "fp8"
        if str(reported or "").lower().startswith("fp8")
        else "none"
        if reported in (None, "", "none")
        else str(reported)
    )
    if served != wanted:
        raise ValueError(
            f"{where} serves quantization={reported!r} but rollout.quantization={wanted}: start the "
            f"server with {'--quantization fp8' if wanted == 'fp8' else 'no --quantization'} or set "
            f"rollout.quantization={served if served in QUANTIZATIONS else 'none'}"
        )
