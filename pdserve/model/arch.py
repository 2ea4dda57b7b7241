"""Architecture numbers of one Llama-family decoder, read from a Hugging Face config.json (or a preset)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.config import ConfigError

# config.json "architectures" entry -> our family name
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
ACTIVATIONS = ("silu", "gelu_tanh")  # gate activation of the MLP: SiLU (Llama family), GELU-tanh (Gemma)


@dataclass(frozen=True)
class ModelArch:
    family: str  # llama | mistral | qwen2 | qwen3 | gemma3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # qwen2: q/k/v projections carry a bias
    qk_norm: bool  # qwen3: per-head RMSNorm on q and k before rotary
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # llama3-style scaling, as sorted items
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention, per layer: the number of keys a query attends to, itself included (query at
    # position p sees keys (p - window, p], as transformers' sliding_window_overlay); None = the whole context.
    # Empty means every layer attends to the whole context.
    layer_windows: tuple[int | None, ...] = ()
    # Gemma deltas (all off for the Llama family)
    hidden_act: str = "silu"  # one of ACTIVATIONS
    norm_offset: bool = False  # gemma: RMSNorm scales by (1 + weight); folded into the weight at load
    sandwich_norms: bool = False  # gemma: norms on the attention and MLP outputs, and one before the MLP
    embed_scale: float | None = None  # gemma: embeddings multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # gemma: attention scale is its -0.5 power (not head_dim's)
    local_rope_theta: float | None = None  # gemma: rotary base of windowed layers (no scaling there)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ConfigError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ConfigError(f"sliding windows must be >= 1 token, got {self.layer_windows}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported hidden activation {self.hidden_act!r}; supported: {ACTIVATIONS}")

    def window_of(self, layer: int) -> int | None:
        """Keys a query of `layer` attends to (itself included); None = the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def is_windowed(self) -> bool:
        """Some layer attends to a sliding window only."""
        return any(w is not None for w in self.layer_windows)

    @property
    def attn_scale(self) -> float:
        """Softmax scale of attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_theta_of(self, layer: int) -> float:
        """Rotary base of `layer` (gemma: windowed layers use the local base)."""
        local = self.local_rope_theta is not None and self.window_of(layer) is not None
        return self.local_rope_theta if local and self.local_rope_theta is not None else self.rope_theta

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Build from a config.json dict; refuses architectures this decoder does not implement."""
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            model_type = cfg.get("model_type")
            family = MODEL_TYPES.get(model_type or "")
        if family is None:
            raise ConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers >= 5 saves rope settings under "rope_parameters" (theta included); 4.x under rope_*
        rope = cfg.get("rope_parameters") or {}
        local_rope: dict[str, Any] = {}
        if isinstance(rope.get("full_attention"), dict):  # transformers >= 5, per layer type (Gemma 3)
            local_rope = rope.get("sliding_attention") or {}
            rope = rope["full_attention"]
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type") or scaling.get("type")
            if kind not in ("llama3", "linear", "default"):
                raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear")
            scaling = None if kind == "default" else tuple(sorted(scaling.items()))
        is_gemma = family == "gemma3"
        if cfg.get("attn_logit_softcapping") is not None:
            raise ConfigError(
                f"attn_logit_softcapping {cfg['attn_logit_softcapping']} is not implemented "
                "(transformers' Gemma 3 ignores it too); serve a config with null"
            )
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),  # each class's default
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "gemma3"),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_windows=_layer_windows(cfg, family),
            hidden_act="gelu_tanh" if is_gemma else "silu",
            norm_offset=is_gemma,
            sandwich_norms=is_gemma,
            embed_scale=float(cfg["hidden_size"]) ** 0.5 if is_gemma else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if is_gemma else None,
            local_rope_theta=cfg.get("rope_local_base_freq", local_rope.get("rope_theta", 10000.0))
            if is_gemma
            else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )


def _layer_windows(cfg: dict[str, Any], family: str) -> tuple[int | None, ...]:
    """Per-layer sliding windows as transformers builds them from a config.json: `layer_types` when the config
    has it; else Mistral: every layer when sliding_window is set; Qwen2/3: layers >= max_window_layers when
    use_sliding_window; Gemma 3: all but every sliding_window_pattern-th layer (default 6)."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if family == "llama" or (family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False)):
        window = None  # LlamaConfig has no window; Qwen2/3 configs drop sliding_window unless use_sliding_window
    if window is None:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        if family in ("qwen2", "qwen3"):
            first = cfg.get("max_window_layers", n)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        elif family == "gemma3":
            pattern = cfg.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            types = ["sliding_attention"] * n
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(f"layer_types must name sliding_attention or full_attention for {n} layers, got {types}")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
