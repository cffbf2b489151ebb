"""``epdserve make-model``: write a tiny random-weight HuggingFace checkpoint.

No weights can be downloaded here, so tests, benchmarks and ``make run`` use these:
a real HF directory (config.json, generation_config.json, model.safetensors, tokenizer
files, chat template) that ``transformers`` loads offline. Same seed, same bytes.

``tiny`` and ``small`` are fp32 and overhead-bound; ``qwen2.5-0.5b`` and ``llama3.2-1b`` are
the shapes users serve, in bf16, text architectures only (``serving_shapes``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from epdserve.engine import serving_shapes
from epdserve.engine.models import arch as registry
from epdserve.engine.models.arch.base import SIZES, VOCAB  # noqa: F401  (the presets' shapes)

ARCHS = registry.make_model_families()
SERVED = (*serving_shapes.SHAPES, *serving_shapes.MOE_SHAPES)  # bf16, the shapes users serve
PRESETS = ("tiny", "small", *SERVED)


def vocab_size(preset: str) -> int:
    """The model's and its tokenizer's vocab."""
    return serving_shapes.VOCAB if preset in SERVED else VOCAB


def build_config(arch: str, preset: str, token_ids: dict[str, int]):
    """The transformers config of ``arch``'s ``preset`` checkpoint (the registry's)."""
    return registry.by_family(arch).hf_config(preset, token_ids)


def make_model(
    arch: str, out: str | Path, seed: int = 0, preset: str = "tiny", lora: int = 0
) -> Path:
    """Write the checkpoint to ``out`` and return its path; ``lora`` random PEFT adapters go
    to ``out/loras/lora{i}`` (engine/lora/random_adapters.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    from epdserve.engine import tiny_tokenizer as tt

    if arch not in ARCHS:
        raise ValueError(f"arch: unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    family = registry.by_family(arch)
    image = family.image
    large = preset in SERVED
    if large and (preset not in family.presets or lora):
        takes = [a.family for a in registry.architectures() if preset in a.presets]
        raise ValueError(f"preset: {preset} is for {', '.join(takes)}, without --lora")
    if preset not in family.presets:
        raise ValueError(f"preset: {arch} takes {', '.join(family.presets)}, not {preset}")
    if lora and family.lora_refusal:
        raise ValueError(f"lora: {family.lora_refusal}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tt.train_tokenizer(vocab_size(preset), with_image_tokens=image)
    hf_tok = tt.save_hf_tokenizer(tok, str(out), with_image_tokens=image)
    ids = {
        "boi": tok.token_to_id(tt.BOI),
        "eoi": tok.token_to_id(tt.EOI),
        "image": tok.token_to_id(tt.IMAGE),
    }
    assert (tok.token_to_id(tt.PAD), tok.token_to_id(tt.BOS), tok.token_to_id(tt.EOS)) == (0, 1, 2)

    config = build_config(arch, preset, ids)
    if large and preset in serving_shapes.SHAPES:
        _save_large(config, out, seed)
        return out
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if large else torch.float32  # a served MoE shape: bf16 whole
    with torch.device("cpu"):
        if image:
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(out))
    if image:
        _save_processor(out, hf_tok, config)
    if lora:
        from epdserve.engine.lora.random_adapters import write_random_adapters

        write_random_adapters(out, lora, seed)
    return out


def _save_large(config, out: Path, seed: int) -> None:
    """bf16 weights written tensor by tensor, the config saying so."""
    import torch
    from transformers import GenerationConfig

    serving_shapes.write_random_weights(config, out / "model.safetensors", seed)
    config.dtype = torch.bfloat16
    config.save_pretrained(str(out))
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(str(out))


def _save_processor(out: Path, hf_tok, config) -> None:
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    size = config.vision_config.image_size
    proc = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(
            size={"height": size, "width": size}, do_pan_and_scan=False
        ),
        tokenizer=hf_tok,
        image_seq_length=config.mm_tokens_per_image,
        chat_template=hf_tok.chat_template,
    )
    proc.save_pretrained(str(out))


def checkpoint_digest(path: str | Path) -> dict[str, str]:
    """sha256 of every file in a checkpoint directory (for determinism checks)."""
    path = Path(path)
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument(
        "--lora", type=int, default=0, metavar="N", help="also write N random PEFT adapters"
    )


def run(args: argparse.Namespace) -> int:
    if args.lora < 0:
        raise SystemExit("make-model: --lora must be at least 0")
    try:
        path = make_model(args.arch, args.out, seed=args.seed, preset=args.preset, lora=args.lora)
    except ValueError as exc:  # a preset that the architecture cannot take
        raise SystemExit(f"make-model: {exc}") from None
    config = json.loads((path / "config.json").read_text())
    print(
        json.dumps(
            {
                "out": str(path),
                "arch": args.arch,
                "preset": args.preset,
                "architectures": config.get("architectures"),
                "loras": sorted(str(p) for p in (path / "loras").glob("*")) if args.lora else [],
            }
        )
    )
    return 0
