"""What the mixture-of-experts architecture modules share: the sparse-layer pattern, the
config fields of routed experts, and make-model's expert sizes. Declares no architecture."""

from __future__ import annotations

# make-model presets: (experts, experts per token, expert intermediate size); small experts
# keep the tiny checkpoints fast (a sparse layer runs each picked expert on its tokens)
EXPERTS = {"tiny": (8, 2, 64), "small": (8, 2, 512)}
# the served shape (serving_shapes.MOE_SHAPES): each family's own kind of experts
SERVED_EXPERTS = {"moe-0.6b": {"mixtral": (8, 2, 2816), "qwen3_moe": (64, 8, 256)}}


def experts(preset: str, family: str) -> tuple[int, int, int]:
    """(experts, experts per token, expert intermediate size) of ``family``'s ``preset``."""
    if preset in SERVED_EXPERTS:
        return SERVED_EXPERTS[preset][family]
    return EXPERTS[preset]


LORA_REFUSAL = (
    "LoRA adapters do not apply to mixture-of-experts models ({family}: the experts have no "
    "adapter slots); serve it without enable_lora"
)


def sparse_layers(raw: dict) -> tuple[bool, ...]:
    """Qwen-MoE's pattern: layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0``
    and ``i`` is not in ``mlp_only_layers``."""
    step = raw.get("decoder_sparse_step") or 1
    dense = set(raw.get("mlp_only_layers") or ())
    return tuple((i + 1) % step == 0 and i not in dense for i in range(raw["num_hidden_layers"]))


def expert_fields(raw: dict, num_experts: int, inter: int, norm_topk_prob: bool) -> dict:
    """The ``ModelConfig`` fields of routed experts (``num_experts`` 0 makes a dense model)."""
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 2),
        moe_intermediate_size=inter,
        norm_topk_prob=norm_topk_prob,
    )
