"""Tensor parallelism inside the decoder: which slice of every weight a rank holds, and the two collectives.

A rank r of N holds (Megatron layout, as vLLM does):
- query heads [r * H/N, (r+1) * H/N) and their rows of q_proj (column-parallel qkv_proj), their columns of
  o_proj (row-parallel: each rank's product is a partial sum, all-reduced);
- KV heads [r * K/N, (r+1) * K/N) when K % N == 0; when N % K == 0 (fewer KV heads than ranks) the one KV head
  its query heads read, kv head r // (N/K), replicated on N/K ranks. GQA groups stay whole on a rank either way;
- intermediate rows [r * I/N, (r+1) * I/N) of gate and of up (column-parallel gate_up_proj), the same columns
  of down_proj (row-parallel, all-reduced);
- vocabulary rows [r * V', (r+1) * V') of the embedding and the LM head, V' = ceil(V / N), zero-padded past
  V: the embedding lookup is masked and all-reduced, the logits all-gathered and cut back to V.
Norms, rotary tables and q/k norms are replicated. TP 1 is the shard that holds everything (no collective).
`param_slices` states these ranges once, for the checkpoint reader (model/checkpoint.py) and shard_param.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.config import ConfigError
from pdserve.model.arch import ModelArch


@dataclass(frozen=True)
class TPShard:
    """The part of a model one tensor-parallel rank holds."""

    rank: int  # 0 .. size - 1
    size: int  # tensor_parallel_size
    num_heads: int  # query heads on this rank
    head_start: int  # first query head of the full model on this rank
    num_kv_heads: int  # KV heads on this rank (and in its KV cache)
    kv_head_start: int  # first KV head of the full model on this rank
    intermediate_size: int  # MLP rows on this rank (of gate, and of up)
    vocab_size: int  # the full model's vocabulary
    vocab_per_rank: int  # embedding / LM-head rows on every rank, ceil(vocab_size / size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def is_parallel(self) -> bool:
        return self.size > 1


def check_tp_split(arch: ModelArch, size: int) -> None:
    """Raise ConfigError naming the head counts when `arch` cannot run on `size` ranks."""
    h, k = arch.num_heads, arch.num_kv_heads
    if h % size:
        raise ConfigError(
            f"tensor_parallel_size {size} does not divide the model's {h} attention heads "
            f"(num_kv_heads {k}); choose a size that divides {h}"
        )
    if k % size and size % k:
        raise ConfigError(
            f"tensor_parallel_size {size} cannot split or replicate the model's {k} KV heads "
            f"({h} attention heads): num_kv_heads must be a multiple of it, or it a multiple of num_kv_heads"
        )
    if arch.intermediate_size % size:
        raise ConfigError(
            f"tensor_parallel_size {size} does not divide the model's intermediate_size {arch.intermediate_size}"
        )


def shard_for(arch: ModelArch, size: int = 1, rank: int = 0) -> TPShard:
    """Rank `rank` of `size`'s part of `arch` (the whole model for size 1); ConfigError if it cannot split."""
    check_tp_split(arch, size)
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is outside tensor_parallel_size {size}")
    h, k = arch.num_heads // size, arch.num_kv_heads
    if k % size == 0:
        k_local, k_start = k // size, rank * (k // size)
    else:  # size % k == 0: size / k ranks share one KV head
        k_local, k_start = 1, rank // (size // k)
    return TPShard(
        rank=rank,
        size=size,
        num_heads=h,
        head_start=rank * h,
        num_kv_heads=k_local,
        kv_head_start=k_start,
        intermediate_size=arch.intermediate_size // size,
        vocab_size=arch.vocab_size,
        vocab_per_rank=-(-arch.vocab_size // size),
    )


class Collectives(Protocol):
    """What the decoder needs from the process group of its ranks (every rank calls each, in the same order)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `x` over ranks (in place; returns x)."""
        ...

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's part at [r * n, (r+1) * n)."""
        ...


class ProcessGroupCollectives:
    """Collectives over a torch.distributed process group (gloo on the CPU, NCCL on CUDA); group None is the
    default group, which need not exist yet when this object is made (only when a collective runs)."""

    def __init__(self, size: int, group: torch.distributed.ProcessGroup | None = None) -> None:
        self.size = size  # ranks in the group
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def abort(self) -> None:
        """Nothing to do: gloo fails a collective on its own once a peer's socket closes."""

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


class NcclCollectives:
    """CUDA: the decoder's collectives on an NCCL communicator of the instance's own (model/cuda/nccl.py), launched on
    the current stream so that a CUDA graph captures them. The process group is used once, to hand rank 0's
    NCCL unique id to every rank. all_gather_last is an all-reduce of a zeroed [size, ..., n] buffer holding
    this rank's part (size x the bytes of a true gather; it runs only on the sampled rows' logits)."""

    def __init__(self, size: int, rank: int, device: torch.device) -> None:
        import torch.distributed as dist

        from pdserve.model.cuda.nccl import NCCL_UNIQUE_ID_BYTES, NcclComm

        self.size, self.rank = size, rank
        uid = torch.zeros(NCCL_UNIQUE_ID_BYTES, dtype=torch.uint8, device=device)
        if rank == 0:
            uid.copy_(torch.frombuffer(bytearray(NcclComm.unique_id()), dtype=torch.uint8))
        dist.broadcast(uid, src=0)
        self._comm = NcclComm(size, rank, bytes(uid.cpu().tolist()))  # every rank joins here

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        self._comm.all_reduce(x)
        return x

    def abort(self) -> None:
        """A rank died: end this rank's pending collectives (model/cuda/nccl.py); later ones raise."""
        self._comm.abort()

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((self.size, *x.shape))
        out[self.rank].copy_(x)
        self._comm.all_reduce(out)
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])


def collectives_for(device: str, size: int, rank: int) -> ProcessGroupCollectives | NcclCollectives:
    """The decoder's collectives once this process joined the process group: NCCL of our own on CUDA, the
    process group (gloo) on the CPU."""
    if device.startswith("cuda"):
        return NcclCollectives(size, rank, torch.device(device))
    return ProcessGroupCollectives(size)


# ---- a rank's slice of every parameter ----------------------------------------------------------------------


@dataclass(frozen=True)
class SliceRange:
    """A contiguous range of one (unfused) tensor along one dimension."""

    dim: int  # 0: rows [start, start + length); 1: columns (a row-parallel weight [out, in])
    start: int  # first row / column kept
    length: int  # rows / columns kept


@dataclass(frozen=True)
class ParamSlices:
    """How rank r's part of one Decoder parameter is made from the parts its full value is fused from."""

    parts: tuple[SliceRange | None, ...]  # one per fused part (q, k, v / gate, up / the tensor); None: whole
    pad_rows: int  # zero rows appended after the parts (vocabulary padding past V)


def fused_part_sizes(name: str, arch: ModelArch) -> tuple[int, ...]:
    """Rows of each part a Decoder parameter is fused from, in order: q, k, v of qkv_proj (weight and bias),
    gate, up of gate_up_proj; one part (0 rows: whatever it has) for every other parameter."""
    leaf, d = name.split(".")[-2], arch.head_dim
    if leaf == "qkv_proj":
        return (arch.num_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d)
    if leaf == "gate_up_proj":
        return (arch.intermediate_size, arch.intermediate_size)
    return (0,)


def param_slices(name: str, arch: ModelArch, shard: TPShard) -> ParamSlices:
    """Rank `shard`'s slice of each part of the Decoder parameter `name` (its parts: fused_part_sizes); the
    one description both the checkpoint reader (model/checkpoint.py) and shard_param (dummy weights) follow."""
    num_parts = len(fused_part_sizes(name, arch))
    if not shard.is_parallel:
        return ParamSlices((None,) * num_parts, 0)
    leaf, d = name.split(".")[-2], arch.head_dim
    if leaf == "qkv_proj":
        kv = SliceRange(0, shard.kv_head_start * d, shard.num_kv_heads * d)  # replicated: the same on N/K ranks
        return ParamSlices((SliceRange(0, shard.head_start * d, shard.num_heads * d), kv, kv), 0)
    if leaf == "o_proj":
        return ParamSlices((SliceRange(1, shard.head_start * d, shard.num_heads * d),), 0)
    n = shard.intermediate_size
    if leaf == "gate_up_proj":
        return ParamSlices((SliceRange(0, shard.rank * n, n), SliceRange(0, shard.rank * n, n)), 0)
    if leaf == "down_proj":
        return ParamSlices((SliceRange(1, shard.rank * n, n),), 0)
    if leaf in ("embed_tokens", "lm_head"):
        start = min(shard.vocab_start, shard.vocab_size)
        rows = min(shard.vocab_per_rank, shard.vocab_size - start)
        return ParamSlices((SliceRange(0, start, rows),), shard.vocab_per_rank - rows)
    return ParamSlices((None,), 0)  # norms, q/k norms: replicated


def shard_param(name: str, full: torch.Tensor, arch: ModelArch, shard: TPShard) -> torch.Tensor:
    """The Decoder parameter `name` (its full, fused, unsharded value) -> this rank's part (dummy weights,
    tests; checkpoints are read slice by slice instead, model/checkpoint.py)."""
    if not shard.is_parallel:
        return full
    sizes = fused_part_sizes(name, arch)
    whole = full.split(list(sizes)) if len(sizes) > 1 else (full,)
    slices = param_slices(name, arch, shard)
    kept = [t if r is None else t.narrow(r.dim, r.start, r.length) for t, r in zip(whole, slices.parts, strict=True)]
    if slices.pad_rows:
        kept.append(full.new_zeros((slices.pad_rows, *full.shape[1:])))
    return kept[0] if len(kept) == 1 else torch.cat(kept)
