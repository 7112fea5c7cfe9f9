"""An HF model directory read lazily and checked: config.json, safetensors (one file or sharded with an index),
tensors (or one row of a tensor) read one at a time; a damaged or inconsistent file is named with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_kl.config import ConfigError, ModelConfig
from megatron_kl.models.hf_config import model_config_from_hf


class HFCheckpointError(ConfigError):
    """A file of an HF model directory is damaged or disagrees with another (the message names the file)."""


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFCheckpointError(
            f"{path} is not valid JSON ({err}): the file is damaged or truncated; copy it again from the model's source"
        ) from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def _safetensors(path: Path):
    """``safe_open`` of one file, a damaged one named (the library's own error says neither file nor fix)."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: the file is what is wrong
        raise HFCheckpointError(
            f"{path} is not a readable safetensors file ({type(err).__name__}: {err}): it is "
            "truncated or damaged; download or convert it again"
        ) from None


# one tensor per role and the config fields its shape follows (families without a name are not checked by it)
_SHAPES = (
    ("model.embed_tokens.weight", ("vocab_size", "hidden_size")),
    ("model.norm.weight", ("hidden_size",)),
    ("model.layers.0.input_layernorm.weight", ("hidden_size",)),
    ("model.layers.0.mlp.up_proj.weight", ("intermediate_size", "hidden_size")),
)


class HFCheckpoint:
    """An HF model directory: config.json and safetensors (single file or sharded with an index),
    tensors read lazily one at a time. Damaged files are named (:class:`HFCheckpointError`)."""

    def __init__(self, path):
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path} is not an HF model directory: config.json is missing")
        self.config = _json_file(config_file)
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = _json_file(index_file).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise HFCheckpointError(f"{index_file} has no weight_map of tensor names to files: it is damaged")
            self.files = dict(weight_map)
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(
                    f"{self.path} has neither model.safetensors nor model.safetensors.index.json "
                    "(only safetensors checkpoints are supported; re-save with safe_serialization)"
                )
            with _safetensors(single) as f:
                self.files = {name: "model.safetensors" for name in f.keys()}
        self._handles: dict = {}

    def check_shapes(self) -> None:
        """Every file opens, and the weights' shapes agree with config.json (hidden size, vocabulary, MLP width):
        a disagreement names the field, its value, the tensor and its shape."""
        for file in sorted(set(self.files.values())):
            if not (self.path / file).is_file():
                raise HFCheckpointError(f"{self.path / file} is listed in the index but missing")
            self._handle(file)
        text_config = self.config.get("text_config") or self.config
        for name, fields in _SHAPES:
            if name not in self.files or not all(isinstance(text_config.get(f), int) for f in fields):
                continue
            expected = [text_config[f] for f in fields]
            shape = list(self._handle(self.files[name]).get_slice(name).get_shape())
            if shape != expected:
                said = ", ".join(f"{f}={v}" for f, v in zip(fields, expected))
                raise HFCheckpointError(
                    f"{self.path / 'config.json'} says {said} but {self.path / self.files[name]} "
                    f"holds {name} of shape {shape} (expected {expected}): config.json and the "
                    "weights disagree; use the config.json the weights were saved with"
                )

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = _safetensors(self.path / file)
        return self._handles[file]

    def model_config(self, **overrides) -> ModelConfig:
        return model_config_from_hf(self.config, **overrides)

    @property
    def dtype(self) -> str:
        return str(self.config.get("torch_dtype") or self.config.get("dtype") or "float32").replace("torch.", "")

    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids generation stops at: ``generation_config.json``'s ``eos_token_id`` (an int
        or a list, e.g. Llama-3.1-Instruct's [128001, 128008, 128009]), else config.json's; [] when neither."""
        for name in ("generation_config.json", "config.json"):
            path = self.path / name
            if not path.is_file():
                continue
            value = _json_file(path).get("eos_token_id")
            if value is None:
                continue
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise ValueError(f"{path}: eos_token_id={value!r} must be a token id or a list of them")
            return list(values)
        return []

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get_row(self, name: str, index: int) -> torch.Tensor:
        """Row ``index`` of tensor ``name`` (its first dimension), read alone from the file."""
        if name not in self.files:
            raise KeyError(
                f"HF checkpoint {self.path} lacks tensor {name!r}: the checkpoint is incomplete or not a "
                f"{self.config.get('model_type')} model of this shape"
            )
        file = self.files[name]
        try:
            return self._handle(file).get_slice(name)[index]
        except Exception as err:  # noqa: BLE001 - a tensor whose bytes cannot be read
            raise HFCheckpointError(
                f"{self.path / file}: tensor {name!r} row {index} cannot be read "
                f"({type(err).__name__}: {err}): the file is truncated or damaged"
            ) from None

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(
                f"HF checkpoint {self.path} lacks tensor {name!r}: the checkpoint is incomplete or not a "
                f"{self.config.get('model_type')} model of this shape"
            )
        file = self.files[name]
        try:
            return self._handle(file).get_tensor(name)
        except HFCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - a tensor whose bytes cannot be read
            raise HFCheckpointError(
                f"{self.path / file}: tensor {name!r} cannot be read ({type(err).__name__}: "
                f"{err}): the file is truncated or damaged; download or convert it again"
            ) from None
