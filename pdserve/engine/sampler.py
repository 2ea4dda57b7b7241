"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds (deterministic per output step)."""

from __future__ import annotations

import torch

from pdserve.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits [N, vocab] float32 -> one token id per row. steps[i] = tokens row i's request generated so far;
    a seeded request draws from a generator seeded by (seed, step), so its output is reproducible."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.is_greedy:
            out.append(greedy[i])
            continue
        row = logits[i] / p.temperature
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
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=probs.device).manual_seed((p.seed * 1_000_003 + steps[i]) % 2**63)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
