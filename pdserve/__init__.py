"""pdserve: prefill/decode disaggregated LLM serving with push- and pull-mode KV transfer over NIXL."""

from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):  # LLM imports torch; keep `import pdserve` light for the router and bench
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
