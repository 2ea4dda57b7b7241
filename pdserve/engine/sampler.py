"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds (deterministic per output step).

Invariant: `sample` never raises on any logits or on any SamplingParams that passed validation. Rows are scaled
in float32 after subtracting their maximum (so the scaled logits are <= 0 and cannot overflow); a row whose
probabilities come out non-finite or all zero (nan/inf logits, a value nobody foresaw) falls back to its
argmax instead of reaching `torch.multinomial`, which would raise inside the engine step.
"""

from __future__ import annotations

import torch

from pdserve.sampling_params import SamplingParams


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """row [vocab] float32 logits -> [vocab] probabilities after temperature, top-k and top-p."""
    row = (row - row.max()) / p.temperature  # <= 0 everywhere (temperature >= GREEDY_TEMPERATURE here)
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        cum = sorted_probs.cumsum(-1)
        drop = cum - sorted_probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
    return probs


def _drawable(probs: torch.Tensor, fallback: int) -> torch.Tensor:
    """probs, or all mass on `fallback` when torch.multinomial could not draw from them (a non-finite entry or
    no mass; softmax and masking keep them >= 0). Decided on the device: no sync beyond the draw's own."""
    ok = torch.isfinite(probs).all() & (probs.sum() > 0)
    one_hot = torch.zeros_like(probs)
    one_hot[fallback] = 1.0
    return torch.where(ok, probs, one_hot)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits [N, vocab] (float32; other dtypes are cast) -> one token id per row. steps[i] = tokens row i's
    request generated so far; a seeded request draws from a generator seeded by (seed, step), so its output
    is reproducible."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.is_greedy:
            out.append(greedy[i])
            continue
        probs = _drawable(_probs(logits[i], p), greedy[i])  # nan/inf logits draw the argmax, never raise
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=probs.device).manual_seed((p.seed * 1_000_003 + steps[i]) % 2**63)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
