"""The router's configuration (what `pdserve proxy`'s flags say), checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.credentials import Credentials
from pdserve.router.kv_index import DEFAULT_MAX_KEYS
from pdserve.router.kv_route import DEFAULT_HIT_WEIGHT, DEFAULT_LOAD_WEIGHT, KVWeights
from pdserve.router.policy import MODES, POLICIES
from pdserve.web import DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class RouterConfig:
    mode: str  # "pull" | "push" | "colocated"
    prefill_urls: tuple[str, ...] = ()  # base URLs of prefill instances (pull, push)
    decode_urls: tuple[str, ...] = ()  # base URLs of decode instances (pull, push)
    instance_urls: tuple[str, ...] = ()  # base URLs of `--kv-role both` instances (colocated)
    colocate_below: int | None = None  # pull/push: uncached suffixes at D below this many tokens go to D alone
    policy: str = "least-loaded"  # --routing: or "round-robin", or "kv-aware" (router/kv_route.py)
    kv_hit_weight: float = DEFAULT_HIT_WEIGHT  # kv-aware: outstanding legs 1,024 cached tokens are worth
    kv_load_weight: float = DEFAULT_LOAD_WEIGHT  # kv-aware: cost per outstanding leg
    kv_index_max_keys: int = DEFAULT_MAX_KEYS  # kv-aware: block keys kept per instance (router/kv_index.py)
    tokenizer: str | None = None  # kv-aware: a tokenizer folder for text prompts; None: the instances' model
    connect_timeout_s: float = 10.0  # to open a connection to a backend
    health_timeout_s: float = 5.0  # for each backend's /health and P's /kv_transfer/info
    health_interval_s: float = 2.0  # every backend's /health is polled this often (router/health.py)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies are refused with 413
    api_key: str | None = field(default=None, repr=False)  # clients must send it (credentials.py)
    # the deployment's internal credential: the router sends it to every instance instead of api_key
    internal_api_key: str | None = field(default=None, repr=False)
    kv_auth_secret: bytes | None = field(default=None, repr=False)  # signs push capabilities (auth.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        KVWeights(self.kv_hit_weight, self.kv_load_weight)  # refuses a negative or infinite weight
        if self.kv_index_max_keys < 1:
            raise ValueError(f"--kv-index-max-keys must be >= 1, got {self.kv_index_max_keys}")
        if not self.health_interval_s > 0 or not self.health_timeout_s > 0:
            raise ValueError("--health-interval-s and --health-timeout-s must be > 0")
        Credentials(self.api_key, self.internal_api_key)  # refuses an empty key, or one key in both roles
        if self.kv_auth_secret is not None and len(self.kv_auth_secret) < 16:
            raise ValueError("the KV auth secret must be at least 16 bytes")
        if self.mode == "colocated":
            if not self.instance_urls:
                raise ValueError("colocated mode needs at least one --instance URL")
            if self.prefill_urls or self.decode_urls:
                raise ValueError("colocated mode takes --instance URLs, not --prefill/--decode")
            if self.colocate_below is not None:
                raise ValueError("--colocate-below applies to pull and push modes only")
        else:
            if not self.prefill_urls or not self.decode_urls:
                raise ValueError(f"{self.mode} mode needs at least one --prefill and one --decode URL")
            if self.instance_urls:
                raise ValueError(f"--instance is for colocated mode; {self.mode} mode takes --prefill and --decode")
            if self.colocate_below is not None and self.colocate_below < 1:
                raise ValueError(f"--colocate-below must be >= 1 token, got {self.colocate_below}")
        for url in self.prefill_urls + self.decode_urls + self.instance_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL {url!r} must start with http:// or https://")

    @property
    def kv_weights(self) -> KVWeights:
        return KVWeights(self.kv_hit_weight, self.kv_load_weight)

    @property
    def credentials(self) -> Credentials:
        return Credentials(self.api_key, self.internal_api_key)

    @property
    def backend_urls(self) -> list[tuple[str, str]]:
        """(leg name, URL) of every backend, as errors name them."""
        if self.mode == "colocated":
            return [("instance", url) for url in self.instance_urls]
        return [("prefill", url) for url in self.prefill_urls] + [("decode", url) for url in self.decode_urls]
