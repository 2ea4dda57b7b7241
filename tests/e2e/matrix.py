"""The combination matrix's case list (issue 25): every supported configuration of a 1P1D deployment.

DIMENSIONS names each dimension and its values, the default first; a new dimension is one line here. The full
product is too large to start in CI, so the cases are
- an all-pairs (pairwise) selection over PAIRED: every pair of values of any two of those dimensions appears in
  at least one case (greedy: each new case covers the most pairs not yet covered); the other dimensions take
  their values in turn over those cases, so each of their values appears too;
- the full product of FULL_PRODUCT with every other dimension at its default.
`cases(...)` is a pure function of these tables; `pytest --collect-only tests/e2e/test_matrix.py` prints the list.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

DIMENSIONS: dict[str, tuple[str, ...]] = {
    "mode": ("push", "pull"),
    "p_tp": ("1", "2"),  # prefill instance's --tensor-parallel-size
    "d_tp": ("1", "2"),  # decode instance's
    "blocks": ("16/16", "16/32", "32/16"),  # --block-size of P / of D
    "model": ("qwen3", "llama1kv", "gemma3"),  # split KV heads; one replicated KV head; two KV groups (windows)
    "d_prefix": ("on", "off"),  # D's prefix caching
    "auth": ("off", "on"),  # --kv-auth-secret on P, D and the router
    "buffer": ("device", "cpu"),  # --kv-buffer-device (host staging where the KV cache is on a GPU)
}
PAIRED = ("mode", "p_tp", "d_tp", "blocks", "model")
FULL_PRODUCT = ("mode", "p_tp", "d_tp")


@dataclass(frozen=True)
class Case:
    mode: str
    p_tp: str
    d_tp: str
    blocks: str
    model: str
    d_prefix: str
    auth: str
    buffer: str

    @property
    def id(self) -> str:
        p_block, d_block = self.blocks.split("/")
        return (f"{self.mode}-p{self.p_tp}d{self.d_tp}-b{p_block}x{d_block}-{self.model}-prefix_{self.d_prefix}"
                f"-auth_{self.auth}-{self.buffer}")  # fmt: skip

    @property
    def block_sizes(self) -> tuple[int, int]:
        p, d = self.blocks.split("/")
        return int(p), int(d)


assert [f.name for f in fields(Case)] == list(DIMENSIONS), "Case must have one field per dimension, in order"


def _pairs(values: dict[str, str], dims: tuple[str, ...]) -> set[tuple[str, str, str, str]]:
    return {(a, values[a], b, values[b]) for a, b in itertools.combinations(dims, 2)}


def pairwise(dims: dict[str, tuple[str, ...]], paired: tuple[str, ...]) -> list[dict[str, str]]:
    """Assignments of the `paired` dimensions covering every pair of values of every two of them (greedy,
    deterministic: the candidate covering most uncovered pairs, the earliest in product order on a tie)."""
    candidates = [dict(zip(paired, combo, strict=True)) for combo in itertools.product(*(dims[d] for d in paired))]
    uncovered = set().union(*(_pairs(c, paired) for c in candidates))
    chosen: list[dict[str, str]] = []
    while uncovered:
        best = max(candidates, key=lambda c: len(_pairs(c, paired) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best, paired)
    return chosen


def cases(
    dims: dict[str, tuple[str, ...]] = DIMENSIONS,
    paired: tuple[str, ...] = PAIRED,
    full: tuple[str, ...] = FULL_PRODUCT,
) -> list[Case]:
    """The pairwise cases, then the full product of `full` at defaults not already among them."""
    out: list[Case] = []
    rest = [d for d in dims if d not in paired]
    for i, assignment in enumerate(pairwise(dims, paired)):
        others, stride = {}, 1
        for d in rest:  # mixed-radix count over the other dimensions: each value in turn, their combinations too
            others[d] = dims[d][(i // stride) % len(dims[d])]
            stride *= len(dims[d])
        out.append(Case(**{**assignment, **others}))
    defaults = {d: values[0] for d, values in dims.items()}
    for combo in itertools.product(*(dims[d] for d in full)):
        case = Case(**{**defaults, **dict(zip(full, combo, strict=True))})
        if case not in out:
            out.append(case)
    return out


def check_coverage(selected: list[Case], dims: dict[str, tuple[str, ...]] = DIMENSIONS) -> None:
    """Raises unless every value of every dimension appears, every pair over PAIRED appears, and the full
    product over FULL_PRODUCT appears at defaults (what the issue asks of the selection)."""
    rows = [{f.name: getattr(c, f.name) for f in fields(Case)} for c in selected]
    for d, values in dims.items():
        missing = set(values) - {r[d] for r in rows}
        assert not missing, f"dimension {d}: values {missing} never appear"
    want = set().union(*(_pairs(dict(zip(PAIRED, combo, strict=True)), PAIRED)
                         for combo in itertools.product(*(dims[d] for d in PAIRED))))  # fmt: skip
    got = set().union(*(_pairs(r, PAIRED) for r in rows))
    assert want <= got, f"pairs never covered: {sorted(want - got)[:5]}"
    defaults = {d: values[0] for d, values in dims.items()}
    for combo in itertools.product(*(dims[d] for d in FULL_PRODUCT)):
        want_case = Case(**{**defaults, **dict(zip(FULL_PRODUCT, combo, strict=True))})
        assert want_case in selected, f"{want_case.id} missing from the full product"
