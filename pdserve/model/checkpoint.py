"""Reading a Hugging Face checkpoint into a Decoder: each rank reads only the slices of each tensor it keeps.

A parameter is made of one or more checkpoint tensors (qkv_proj from q/k/v_proj, gate_up_proj from
gate/up_proj, the others from one), and model/parallel.py's `param_slices` says which range of each one a
tensor-parallel rank keeps: row ranges for column-parallel weights and the vocabulary, column ranges for
row-parallel o_proj / down_proj, whole norms. Each range is read with safetensors' `get_slice` and copied
straight into the rank's parameter, so a rank of N reads about 1/N of the checkpoint and never holds a whole
tensor, nor a fused one (TP 1 reads every tensor whole, one at a time). A column range of a row-major tensor
still touches part of every row: below a page per row the kernel reads whole pages, so the bytes a rank
pulls from disk for o_proj / down_proj can exceed its share; the memory it keeps does not.

GGUF files reach this reader as the safetensors folder they were converted to (loader.gguf_to_folder), so a
rank reads its slices from the converted cache too; the one-time conversion itself loads the whole model
(transformers).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pdserve.config import ConfigError
from pdserve.model.arch import ModelArch
from pdserve.model.decoder import Decoder
from pdserve.model.parallel import SliceRange, param_slices


class CheckpointReader(Protocol):
    """Tensors of a checkpoint by Hugging Face name, read a range at a time."""

    def __contains__(self, name: object) -> bool: ...

    def read(self, name: str, part: SliceRange | None) -> torch.Tensor:
        """Tensor `name`, or only `part` of it (rows or columns); raises ConfigError if the range is out of it."""
        ...


class SafetensorsWeights:
    """A folder's *.safetensors files, read a slice at a time through `safe_open(...).get_slice`."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
            raise ConfigError(f"no *.safetensors weights in {folder} (found: {found}); only safetensors load")
        self._file_of: dict[str, Any] = {}  # tensor name -> open safetensors handle
        self.used: set[str] = set()  # names read so far
        self.num_bytes_read = 0  # bytes of the tensors `read` returned (a rank of N: about 1/N of the checkpoint)
        for f in files:
            handle = safe_open(str(f), framework="pt", device="cpu")
            for key in handle.keys():
                self._file_of[key] = handle

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def read(self, name: str, part: SliceRange | None) -> torch.Tensor:
        if name not in self._file_of:
            raise ConfigError(f"weight {name!r} missing from checkpoint")
        handle = self._file_of[name]
        if part is None:
            tensor = handle.get_tensor(name)
        else:
            view = handle.get_slice(name)
            shape = view.get_shape()
            if len(shape) <= part.dim or part.start + part.length > shape[part.dim]:
                raise ConfigError(f"weight {name!r} of shape {shape} has no {_describe(part)}")
            stop = part.start + part.length
            tensor = view[part.start : stop] if part.dim == 0 else view[:, part.start : stop]
        self.used.add(name)
        self.num_bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _describe(part: SliceRange) -> str:
    return f"{('rows', 'columns')[part.dim]} [{part.start}, {part.start + part.length})"


@dataclass(frozen=True)
class ParamSource:
    """The checkpoint tensors one Decoder parameter is made of."""

    param: str  # Decoder parameter name ("layers.3.qkv_proj.weight")
    tensors: tuple[str, ...]  # Hugging Face names of its fused parts, in order (model/parallel.py's parts)


def hf_sources(arch: ModelArch, tied: bool, reader: CheckpointReader) -> Iterator[ParamSource]:
    """Every Decoder parameter with the Hugging Face (*ForCausalLM) tensors it is fused from."""
    embed = "model.embed_tokens.weight"
    yield ParamSource("embed_tokens.weight", (embed,))
    yield ParamSource("norm.weight", ("model.norm.weight",))
    if not tied:  # an untied model without lm_head.weight reuses the embedding
        yield ParamSource("lm_head.weight", ("lm_head.weight" if "lm_head.weight" in reader else embed,))
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        a, m, ours = p + "self_attn.", p + "mlp.", f"layers.{i}."
        yield ParamSource(ours + "qkv_proj.weight", tuple(a + f"{x}_proj.weight" for x in "qkv"))
        if arch.qkv_bias:
            yield ParamSource(ours + "qkv_proj.bias", tuple(a + f"{x}_proj.bias" for x in "qkv"))
        yield ParamSource(ours + "o_proj.weight", (a + "o_proj.weight",))
        norms = ["input_layernorm", "post_attention_layernorm"]
        if arch.qk_norm:
            yield ParamSource(ours + "q_norm.weight", (a + "q_norm.weight",))
            yield ParamSource(ours + "k_norm.weight", (a + "k_norm.weight",))
        if arch.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            yield ParamSource(ours + f"{norm}.weight", (p + f"{norm}.weight",))
        yield ParamSource(ours + "gate_up_proj.weight", (m + "gate_proj.weight", m + "up_proj.weight"))
        yield ParamSource(ours + "down_proj.weight", (m + "down_proj.weight",))


@torch.no_grad()
def load_checkpoint(decoder: Decoder, reader: CheckpointReader) -> None:
    """Fill every parameter of `decoder` (its rank's shard) from `reader`, one slice at a time: each part is
    copied into its rows of the parameter (no fused or whole tensor is built), vocabulary padding zeroed.
    Gemma's (1 + weight) norms are folded in float32 here."""
    arch = decoder.arch
    params = dict(decoder.named_parameters())
    for source in hf_sources(arch, tied=decoder.lm_head is None, reader=reader):
        param = params[source.param]
        slices = param_slices(source.param, arch, decoder.shard)
        row = 0
        for name, part in zip(source.tensors, slices.parts, strict=True):
            tensor = reader.read(name, part)
            if arch.norm_offset and name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0
            rows = tensor.shape[0] if tensor.dim() else 0
            target = param.narrow(0, row, max(0, min(rows, param.shape[0] - row)))
            if tensor.shape != target.shape:  # copy_ would broadcast a wrong shape silently
                raise ConfigError(
                    f"weight {name!r}{'' if part is None else ' ' + _describe(part)} has shape "
                    f"{tuple(tensor.shape)}, the model's config expects {tuple(target.shape)} there"
                )
            target.copy_(tensor)
            row += rows
        if row + slices.pad_rows != param.shape[0]:
            raise ConfigError(f"{source.tensors} give {row} rows of {source.param}, expected {param.shape[0]}")
        param.narrow(0, row, slices.pad_rows).zero_()
