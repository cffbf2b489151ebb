"""Random PEFT LoRA adapters for a ``make-model`` checkpoint (``make-model --lora N``).

Each is a PEFT directory as ``peft``'s ``save_pretrained`` writes it: ``adapter_config.json``
and ``adapter_model.safetensors`` with keys
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``. B is nonzero (PEFT
starts it at zero), so every adapter changes the model's outputs. Same seed, same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from epdserve.engine.lora.peft_files import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, module_shapes
from epdserve.engine.models.config import load_model_config

RANKS = (8, 16, 4, 8)  # adapter i gets RANKS[i % 4]: ranks differ, so padding is exercised


def adapter_name(i: int) -> str:
    return f"lora{i}"


def adapter_config(rank: int, alpha: int, base: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def key_prefix(family: str) -> str:
    """Where the architecture's PEFT adapters keep its layers (the registry says)."""
    from epdserve.engine.models import arch as registry

    return registry.by_family(family).lora_prefix


def write_random_adapters(
    model_dir: str | Path, count: int, seed: int = 0, out: str | Path | None = None
) -> list[Path]:
    """Write ``count`` adapters of the model in ``model_dir`` to ``out/lora{i}`` (default
    ``model_dir/loras``); returns their paths."""
    import torch
    from safetensors.torch import save_file

    cfg = load_model_config(model_dir)
    shapes = module_shapes(cfg)
    prefix = key_prefix(cfg.family)
    paths = []
    for i in range(count):
        rank = RANKS[i % len(RANKS)]
        gen = torch.Generator().manual_seed(seed * 1000 + i + 1)
        tensors = {}
        for layer in range(cfg.num_layers):
            for module in TARGET_MODULES:
                fan_in, fan_out = shapes[module]
                part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                base = f"{prefix}layers.{layer}.{part}.{module}"
                a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                b = torch.randn(fan_out, rank, generator=gen) * 0.25 / rank**0.5
                tensors[f"{base}.lora_A.weight"] = a.contiguous()
                tensors[f"{base}.lora_B.weight"] = b.contiguous()
        where = Path(out or Path(model_dir) / "loras") / adapter_name(i)
        where.mkdir(parents=True, exist_ok=True)
        config = adapter_config(rank, 2 * rank, str(Path(model_dir).resolve()))
        (where / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(where / WEIGHTS_FILE), metadata={"format": "pt"})
        paths.append(where)
    return paths
