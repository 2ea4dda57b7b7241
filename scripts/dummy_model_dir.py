"""Write a shape preset as a model folder with a synthetic tokenizer, for serving benchmarks with random weights.

    python scripts/dummy_model_dir.py qwen3-0.6b /tmp/qwen3-0.6b-dummy
    pdserve serve /tmp/qwen3-0.6b-dummy --load-format dummy ...

A bare preset has no tokenizer, so the server's stream carries no text and (it sends a chunk only when the
text grows) the whole answer arrives in its last chunk: a client then measures TTFT = end-to-end latency
and no inter-token gaps. Here every id of the preset's vocabulary gets its own printable word-level token
("t123 "), so each generated token is one non-empty streamed chunk, as with a real model. Prompts stay
token-id lists (the bench sends ids), so the tokenizer never changes what the engine computes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write(preset: str, folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pdserve.model.presets import get_preset

    cfg = get_preset(preset)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    hf.save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", help="shape preset name, e.g. qwen3-0.6b")
    ap.add_argument("folder", type=Path)
    a = ap.parse_args()
    print(write(a.preset, a.folder))


if __name__ == "__main__":
    main()
