"""What loading a model imports: an instance's start stays free of torch._dynamo, a TP rank's of transformers.

Every `pdserve serve` pays its imports before /health answers, and the e2e tests start hundreds of instances.
torch._dynamo (with inductor and functorch) was ~2 s of CPU per start, pulled in by nothing the engine runs:
nn.Embedding's init and torch.arange on the meta device (model/decoder.py, model/rotary.py) and transformers'
AutoTokenizer (model/tokenizer.py). A tensor-parallel rank other than 0 loads no tokenizer (engine/tp/bring_up.py),
so it never imports transformers (~1.5 s of CPU per rank process).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.model.tokenizer import Tokenizer

LOAD_AND_REPORT = """
import sys
from pdserve.config import ModelConfig
from pdserve.model.loader import load_model
cfg = ModelConfig(model=sys.argv[1], num_threads=1)
assert load_model(cfg, with_tokenizer=False).tokenizer is None  # as a TP rank > 0 loads it
print(sorted(m for m in sys.modules if m == "transformers"))
assert load_model(cfg).tokenizer is not None
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo") or m == "torch._inductor"))
"""


def test_loading_a_model_does_not_import_dynamo(tiny_model_dirs: dict[str, Path]) -> None:
    """A fresh interpreter loads the tiny Llama without a tokenizer, as a TP rank > 0 does (no transformers after),
    then the whole model (weights, tokenizer, packed linears): no torch._dynamo after."""
    run = subprocess.run(
        [sys.executable, "-c", LOAD_AND_REPORT, str(tiny_model_dirs["llama"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["[]", "[]"], run.stdout


def test_generic_fast_tokenizer_is_the_one_auto_tokenizer_picks(tiny_model_dirs: dict[str, Path]) -> None:
    """The shortcut past AutoTokenizer (a folder naming PreTrainedTokenizerFast) builds the same tokenizer."""
    folder = tiny_model_dirs["llama"]
    ours, auto = Tokenizer.from_pretrained(folder).hf, AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto) is PreTrainedTokenizerFast
    text = "Héllo, wörld! <|im_start|> done"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert ours.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (auto.bos_token_id, auto.eos_token_id, len(auto))
    assert ours.chat_template == auto.chat_template
