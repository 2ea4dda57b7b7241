"""Resolve a model name or path, build the Decoder on the target device and dtype, and load its weights.

Accepted `ModelConfig.model` values:
  - a built-in name ("smollm2-135m"): a GGUF file inside an installed package (see builtin.py);
  - a Hugging Face folder: config.json + *.safetensors (+ tokenizer files);
  - a .gguf file: converted once by transformers (dequantized, llama q/k un-permuted) and cached as a
    Hugging Face folder under $XDG_CACHE_HOME/pdserve (default ~/.cache/pdserve);
  - with load_format="dummy": a shape preset name (see presets.py) or a folder's config.json, random weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from pdserve.config import ConfigError, ModelConfig
from pdserve.model.arch import ModelArch
from pdserve.model.builtin import builtin_gguf_path, builtin_names, is_builtin
from pdserve.model.checkpoint import SafetensorsWeights, load_checkpoint
from pdserve.model.decoder import Decoder, pack_cpu_linears, use_column_major_linears
from pdserve.model.decoder_layer import RMSNorm
from pdserve.model.parallel import Collectives, TPShard, shard_for, shard_param
from pdserve.model.presets import get_preset, is_preset, preset_names
from pdserve.model.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 8192  # cap on the default context length (the KV cache is sized for it)
DUMMY_INIT_STD = 0.02  # std of dummy weights (norm weights are ones)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    name: str  # the built-in / preset name, or the folder's or .gguf file's name
    arch: ModelArch  # architecture numbers the decoder was built from
    decoder: Decoder  # on cfg.device and cfg.dtype, eval mode, requires_grad off
    tokenizer: Tokenizer | None  # None for dummy presets: the engine takes token-id prompts only
    max_model_len: int  # longest sequence (prompt + output) the engine admits


def load_model(
    cfg: ModelConfig,
    tp_size: int = 1,
    tp_rank: int = 0,
    comm: Collectives | None = None,
    device: str | None = None,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load the model `cfg.model` names; raises ConfigError with the known choices when it cannot.

    With tp_size > 1 the decoder holds rank `tp_rank`'s part of every weight (model/parallel.py) and runs its
    collectives through `comm`; `device` overrides cfg.device (rank r of a CUDA instance uses its own GPU).
    with_tokenizer False: LoadedModel.tokenizer is None (a rank other than 0 never tokenizes, and loading one
    imports transformers, ~1.5 s of CPU)."""
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    device_, dtype = torch.device(device or cfg.device), TORCH_DTYPES[cfg.dtype]
    if cfg.load_format == "dummy":
        name, folder = _dummy_source(cfg.model)
        hf_cfg = get_preset(cfg.model) if folder is None else _read_config(folder)
        arch = ModelArch.from_hf_config(hf_cfg)
        decoder = build_decoder(arch, device_, dtype, shard_for(arch, tp_size, tp_rank), comm)
        init_dummy_weights(decoder, cfg.seed)
        tokenizer = None if folder is None or not with_tokenizer else load_tokenizer(folder, arch)
    else:
        name, folder = _weights_folder(cfg.model)
        hf_cfg = _read_config(folder)
        arch = ModelArch.from_hf_config(hf_cfg)
        decoder = build_decoder(arch, device_, dtype, shard_for(arch, tp_size, tp_rank), comm)
        weights = SafetensorsWeights(folder)
        load_checkpoint(decoder, weights)  # a rank reads only its slices
        _check_all_used(weights, folder)
        tokenizer = load_tokenizer(folder, arch) if with_tokenizer else None
    decoder.eval().requires_grad_(False)
    if device_.type == "cpu":
        use_column_major_linears(decoder)
        pack_cpu_linears(decoder)
    return LoadedModel(name, arch, decoder, tokenizer, _max_model_len(cfg, arch))


def model_arch(cfg: ModelConfig) -> ModelArch:
    """The architecture numbers of `cfg.model` without loading weights (a .gguf is converted first, once)."""
    if cfg.load_format == "dummy":
        _, folder = _dummy_source(cfg.model)
        return ModelArch.from_hf_config(get_preset(cfg.model) if folder is None else _read_config(folder))
    return ModelArch.from_hf_config(_read_config(_weights_folder(cfg.model)[1]))


def known_models_hint() -> str:
    """One line naming every built-in model and shape preset, for error messages and --help."""
    return (
        f"built-in models: {', '.join(builtin_names())}; shape presets (load_format='dummy'): "
        f"{', '.join(preset_names())}; or a Hugging Face folder, or a .gguf file"
    )


def build_decoder(
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    shard: TPShard | None = None,
    comm: Collectives | None = None,
) -> Decoder:
    """A Decoder (this rank's `shard` of it) with uninitialized weights allocated directly on `device` in
    `dtype` (no float32 CPU copy). The rotary inverse frequencies stay float32 whatever `dtype` is.
    """
    with torch.device("meta"):
        decoder = Decoder(arch, shard, comm)
    decoder = decoder.to(dtype=dtype).to_empty(device=device)
    decoder.reset_rope(device)  # [head_dim / 2] float32
    return decoder


@torch.no_grad()
def init_dummy_weights(decoder: Decoder, seed: int) -> None:
    """Random weights ~ N(0, DUMMY_INIT_STD^2) drawn on the decoder's device from `seed`; norm weights 1.

    A tensor-parallel rank draws every full weight in the same order as TP 1 and keeps its part, so the
    weights (and the output) do not depend on the TP size."""
    device = decoder.embed_tokens.weight.device
    if device.type == "meta":  # shapes only (tests, memory planning): nothing to draw
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_params = {id(m.weight) for m in decoder.modules() if isinstance(m, RMSNorm)}
    if not decoder.shard.is_parallel:
        for param in decoder.parameters():
            if id(param) in norm_params:
                param.fill_(1.0)
            else:
                param.normal_(0.0, DUMMY_INIT_STD, generator=gen)
        return
    with torch.device("meta"):
        full = Decoder(decoder.arch)  # shapes of the unsharded parameters, in the same order
    params = dict(decoder.named_parameters())
    for name, meta in full.named_parameters():
        param = params[name]
        if id(param) in norm_params:
            param.fill_(1.0)
            continue
        drawn = torch.empty(meta.shape, dtype=param.dtype, device=device).normal_(0.0, DUMMY_INIT_STD, generator=gen)
        param.copy_(shard_param(name, drawn, decoder.arch, decoder.shard))


def _check_all_used(weights: SafetensorsWeights, folder: Path) -> None:
    """Refuse a checkpoint with weights the decoder ignored (an o_proj or MLP bias, say): its output would be wrong."""
    ignorable = ("rotary_emb.inv_freq", "lm_head.weight")  # derived buffers; a tied head stored anyway
    unused = sorted(k for k in weights if k not in weights.used and not k.endswith(ignorable))
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise ConfigError(
            f"{folder}: the decoder does not implement weights {shown} (unsupported architecture variant)"
        )


def load_tokenizer(folder: Path, arch: ModelArch) -> Tokenizer | None:
    """The folder's tokenizer, with eos ids from config.json and generation_config.json; None if it has none."""
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        return None
    eos = set(arch.eos_token_ids)
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    return Tokenizer.from_pretrained(folder, extra_eos_token_ids=eos)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.exists():
        raise ConfigError(f"{folder} has no config.json; a model folder holds config.json and *.safetensors")
    return cast(dict[str, Any], json.loads(path.read_text()))


def _dummy_source(model: str) -> tuple[str, Path | None]:
    """(name, folder) for dummy weights: folder None means a shape preset."""
    if is_preset(model):
        return model, None
    path = Path(model).expanduser()
    if path.is_dir():
        return path.name, path
    raise ConfigError(
        f"load_format='dummy' needs a shape preset or a folder with config.json, got {model!r}; "
        f"shape presets: {', '.join(preset_names())}"
    )


def _weights_folder(model: str) -> tuple[str, Path]:
    """(name, Hugging Face folder holding the weights) for a built-in name, a folder or a .gguf file."""
    if is_builtin(model):
        return model, gguf_to_folder(builtin_gguf_path(model), model)
    path = Path(model).expanduser()
    if path.is_dir():
        return path.name, path
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, gguf_to_folder(path, path.stem)
    if path.suffix == ".gguf":
        raise ConfigError(f"GGUF file {model!r} does not exist")
    if is_preset(model):
        raise ConfigError(f"{model!r} is a shape preset without weights; pass load_format='dummy' to use it")
    raise ConfigError(f"unknown model {model!r}: not a built-in name, folder or .gguf file; {known_models_hint()}")


def _max_model_len(cfg: ModelConfig, arch: ModelArch) -> int:
    """The context length served: sliding-window models too are served up to max_position_embeddings (their
    windowed layers attend to the last `window` tokens, model/attention.py)."""
    limit = arch.max_position_embeddings
    if cfg.max_model_len is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if cfg.max_model_len > limit:
        raise ConfigError(f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings = {limit}")
    return cfg.max_model_len


def cache_root() -> Path:
    """Folder of pdserve's converted-weights cache: $XDG_CACHE_HOME/pdserve, default ~/.cache/pdserve."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def gguf_cache_folder(path: Path, name: str) -> Path:
    """Where the conversion of `path` lives; the key changes when the file's size or mtime does."""
    st = path.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{name}-{key}"


def gguf_to_folder(path: Path, name: str) -> Path:
    """A Hugging Face folder (config.json, model.safetensors float32, tokenizer files) converted from a GGUF.

    Converts on the first call (transformers dequantizes; ~30 s for 135M parameters on 2 cores) and reuses
    the cached folder afterwards. The folder is written to a temporary name and renamed, so a crash or a
    concurrent loader never leaves a half-written cache entry.
    """
    dest = gguf_cache_folder(path, name)
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        t0 = time.perf_counter()
        print(f"pdserve: converting {path.name} to {dest} (once; later loads use the cache)", file=sys.stderr)
        _convert_gguf(path, tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").exists():  # not a concurrent loader that won the race
                raise
        print(f"pdserve: converted {path.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert_gguf(path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.save_pretrained(str(out))
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # a GGUF without tokenizer metadata still serves token-id prompts
        print(f"pdserve: no tokenizer in {path.name} ({type(e).__name__}: {e})", file=sys.stderr)
        return
    _fix_gguf_tokenizer(tok, path)
    tok.save_pretrained(str(out))


def _fix_gguf_tokenizer(tok: Any, path: Path) -> None:
    """Apply the GGUF's BOS/EOS metadata, which transformers' conversion drops (transformers 4.57:
    SmolLM2's tokenizer came back with eos = <|im_start|> and a BOS added despite add_bos_token=False)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def meta(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    for attr, key in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")):
        token_id = meta(key)
        if token_id is not None:
            setattr(tok, attr, tok.convert_ids_to_tokens(int(token_id)))
    add_bos = meta("tokenizer.ggml.add_bos_token")
    if add_bos is not None and hasattr(tok, "add_bos_token"):
        tok.add_bos_token = bool(add_bos)  # the Llama fast tokenizer rebuilds its post-processor
