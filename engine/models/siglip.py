"""SigLIP vision tower + Gemma3 multimodal projector: pixels -> text-space embeddings.

Bidirectional ViT (patch conv, learned positions, pre-norm blocks with GELU-tanh MLPs),
then average pooling to ``mm_tokens_per_image`` tokens, a (1+w) RMSNorm and a projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int
    text_norm_eps: float

    @classmethod
    def from_hf(cls, top: dict) -> VisionConfig:
        v, t = top["vision_config"], top["text_config"]
        return cls(
            v["hidden_size"],
            v["intermediate_size"],
            v["num_hidden_layers"],
            v["num_attention_heads"],
            v["image_size"],
            v["patch_size"],
            v.get("layer_norm_eps", 1e-6),
            top.get("mm_tokens_per_image", 256),
            t["hidden_size"],
            t.get("rms_norm_eps", 1e-6),
        )


class VisionEncoder:
    """``encode(pixel_values [B,3,H,W]) -> [B, mm_tokens_per_image, text_hidden]``."""

    def __init__(self, config: VisionConfig, get, dtype: torch.dtype):
        self.config = config
        self.dtype = dtype
        pre = (
            "vision_tower.vision_model."
            if get.has("vision_tower.vision_model.embeddings.patch_embedding.weight")
            else "vision_tower."
        )
        self.w = {name: get(name) for name in get.names(pre)}
        self.pre = pre
        self.proj = get("multi_modal_projector.mm_input_projection_weight")
        self.soft_norm = 1.0 + get("multi_modal_projector.mm_soft_emb_norm.weight").float()

    def _p(self, name: str) -> torch.Tensor:
        return self.w[self.pre + name]

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        x = pixel_values.to(self.dtype)
        x = F.conv2d(
            x,
            self._p("embeddings.patch_embedding.weight"),
            self._p("embeddings.patch_embedding.bias"),
            stride=cfg.patch_size,
        )
        x = x.flatten(2).transpose(1, 2) + self._p("embeddings.position_embedding.weight")
        for i in range(cfg.num_layers):
            x = self._block(x, f"encoder.layers.{i}.")
        x = F.layer_norm(
            x,
            (cfg.hidden_size,),
            self._p("post_layernorm.weight"),
            self._p("post_layernorm.bias"),
            cfg.layer_norm_eps,
        )
        return self._project(x)

    def _block(self, x: torch.Tensor, p: str) -> torch.Tensor:
        cfg = self.config
        h = F.layer_norm(
            x,
            (cfg.hidden_size,),
            self._p(p + "layer_norm1.weight"),
            self._p(p + "layer_norm1.bias"),
            cfg.layer_norm_eps,
        )
        x = x + self._attention(h, p + "self_attn.")
        h = F.layer_norm(
            x,
            (cfg.hidden_size,),
            self._p(p + "layer_norm2.weight"),
            self._p(p + "layer_norm2.bias"),
            cfg.layer_norm_eps,
        )
        h = F.gelu(
            F.linear(h, self._p(p + "mlp.fc1.weight"), self._p(p + "mlp.fc1.bias")),
            approximate="tanh",
        )
        return x + F.linear(h, self._p(p + "mlp.fc2.weight"), self._p(p + "mlp.fc2.bias"))

    def _attention(self, h: torch.Tensor, p: str) -> torch.Tensor:
        cfg = self.config
        b, n, _ = h.shape
        heads, dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads

        def proj(name):
            y = F.linear(h, self._p(p + f"{name}_proj.weight"), self._p(p + f"{name}_proj.bias"))
            return y.view(b, n, heads, dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(proj("q"), proj("k"), proj("v"), scale=dim**-0.5)
        out = out.transpose(1, 2).reshape(b, n, cfg.hidden_size)
        return F.linear(out, self._p(p + "out_proj.weight"), self._p(p + "out_proj.bias"))

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        b, n, c = x.shape
        side = int(math.isqrt(n))
        tokens_side = int(math.isqrt(cfg.mm_tokens_per_image))
        grid = x.transpose(1, 2).reshape(b, c, side, side)
        pooled = F.avg_pool2d(grid, side // tokens_side, side // tokens_side)
        pooled = pooled.flatten(2).transpose(1, 2)
        normed = pooled.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + cfg.text_norm_eps)
        normed = (normed * self.soft_norm).to(x.dtype)
        return torch.matmul(normed, self.proj).to(x.dtype)
