"""Frozen, validated configuration. Values learned at run time live in runtime objects, never here."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

KVRole = Literal["prefill", "decode", "both"]
TransferMode = Literal["pull", "push"]


class ConfigError(ValueError):
    """A configuration value a user chose is invalid; the message says which and why."""


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a preset/built-in name ("smollm2-135m", "qwen3-8b"), a HF folder, or a .gguf file
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"  # "cpu", "cuda", "cuda:1"
    load_format: Literal["auto", "dummy"] = "auto"  # dummy = random weights for a shape preset
    max_model_len: int | None = None  # None = the model's max_position_embeddings (capped at 8192)
    seed: int = 0  # seed for dummy weights
    num_threads: int | None = None  # torch intra-op threads on the CPU; None = torch's default
    enforce_eager: bool = False  # CUDA: never capture or replay decode graphs (engine/cuda_graphs.py)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must be a name, a folder or a .gguf file")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.dtype!r} is not one of float32, bfloat16, float16")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format {self.load_format!r} is not one of auto, dummy")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # None = derived from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0  # memory for the KV cache when num_blocks is None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests in RUNNING at once
    max_num_batched_tokens: int = 2048  # token budget per engine step (chunked prefill)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class TransferConfig:
    role: KVRole = "both"  # both = colocated serving, no transfer
    mode: TransferMode = "pull"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    kv_buffer_device: Literal["device", "cpu"] = "device"
    lease_s: float = 30.0  # P frees blocks nobody consumed after this long (counted as expired)
    # Push: neither clock below runs out while P has the prefill queued or running (P learns of it at arrival,
    # keeps D's registration and restarts D's clock with PushQueued): they need not cover an overloaded P's
    # queue (docs/architecture.md, "Push under an overloaded prefill instance").
    push_registration_timeout_s: float = 30.0  # P drops a registration for a transfer it has no request for
    recv_timeout_s: float = 60.0  # D fails (or recomputes) a request whose KV has not landed by then
    load_failure_policy: Literal["fail", "recompute"] = "fail"
    # --kv-checksum: P sums every transferred part, D sums what it received and runs the request only if they
    # match (a mismatch fails it by load_failure_policy); both ends must agree (transfer/checksum.py)
    kv_checksum: bool = False
    # Liveness (docs/architecture.md, "Liveness"): a peer this instance holds state for is pinged this often on
    # its side channel; one silent for peer_timeout_s (or answering as another process) is dead: its requests
    # fail (or recompute) at once. peer_timeout_s also bounds D's wait for P's PullReleaseAck (restarted after
    # other READs from P in flight, up to P's lease: thread/pull_confirm.py).
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 4.0
    # The deployment secret (auth.py): signs capabilities and authenticates the side channel; None: neither
    # (the instance warns at startup). Never printed (repr=False).
    auth_secret: bytes | None = field(default=None, repr=False)
    # UCX_NET_DEVICES for the NIXL agent ("lo", "eth0", "mlx5_0:1"); None: the side-channel host's interface
    # unless the operator set UCX_NET_DEVICES (transfer/thread/netdev.py)
    net_devices: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ConfigError(f"kv role {self.role!r} is not one of prefill, decode, both")
        if self.mode not in ("pull", "push"):
            raise ConfigError(f"kv transfer mode {self.mode!r} is not one of pull, push")
        if self.kv_buffer_device not in ("device", "cpu"):
            raise ConfigError(f"kv_buffer_device {self.kv_buffer_device!r} is not one of device, cpu")
        if self.load_failure_policy not in ("fail", "recompute"):
            raise ConfigError(f"load failure policy {self.load_failure_policy!r} is not one of fail, recompute")
        if self.auth_secret is not None and len(self.auth_secret) < 16:
            raise ConfigError("the KV auth secret must be at least 16 bytes")
        if self.net_devices is not None and not self.net_devices.strip():
            raise ConfigError("kv net devices must name at least one device")
        for name in ("lease_s", "push_registration_timeout_s", "recv_timeout_s", "heartbeat_s", "peer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise ConfigError(f"peer_timeout_s ({self.peer_timeout_s}) must exceed heartbeat_s ({self.heartbeat_s})")

    @property
    def is_disaggregated(self) -> bool:
        return self.role != "both"


@dataclass(frozen=True)
class ParallelConfig:
    """How one instance spreads its model over processes (docs/architecture.md, "Tensor parallelism").

    Whether the model's head counts split over tensor_parallel_size ranks is checked when its shape is known
    (model/parallel.py, shard_for): attention heads must divide; KV heads split when num_kv_heads % N == 0
    and are replicated when N % num_kv_heads == 0.
    """

    tensor_parallel_size: int = 1  # ranks (one process each); rank 0 is the engine process

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    @property
    def is_parallel(self) -> bool:
        return self.tensor_parallel_size > 1


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        t = self.transfer
        staged = t.kv_buffer_device == "cpu" and self.model.device.startswith("cuda")
        if staged and self.parallel.tensor_parallel_size > 1 and t.mode == "pull" and t.role == "prefill":
            # ranks >= 1 copy into their host mirror only when the step's transfer message reaches them, which
            # can be after P answered: D could READ a stale mirror. Refused until that copy is ordered.
            raise ConfigError(
                "--kv-buffer-device cpu with --tensor-parallel-size > 1 is not supported for a pull prefill "
                "instance yet (a rank's host mirror may be read before it is filled); use --kv-buffer-device device"
            )
