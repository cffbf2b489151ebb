"""A PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``), read and
checked against the base model: the edge where an adapter's files become typed values.

``inspect_adapter`` reads the config and the safetensors header only (no torch, no tensor
bytes), so the API process can refuse a bad adapter at load with a message naming the
problem; ``load_adapter`` then reads the tensors (the engine core, off its step loop).
Pickled weights (``adapter_model.bin``) are never read.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from epdserve.engine.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FLOAT_DTYPES = ("F32", "F16", "BF16")
MAX_HEADER_BYTES = 64 << 20
# the text decoder's layers under the prefixes PEFT gives them (causal LM, Gemma3 image+text)
KEY = re.compile(
    r"base_model\.model\.(?:model\.|model\.language_model\.|language_model\.model\.)"
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter is, from its config and header: its rank, the scale of its delta
    (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), its target modules and, per
    ``(layer, module)``, the names of its A and B tensors."""

    path: str
    rank: int
    scaling: float
    modules: tuple[str, ...]
    tensors: dict[tuple[int, str], tuple[str, str]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each target module of the base model."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def inspect_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> AdapterSpec:
    """Check an adapter directory against the base model; ``ValueError`` names the problem
    (missing or malformed file, rank above ``max_rank``, unknown target module, a tensor of
    the wrong shape or name)."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"lora_path: {path} is not a directory")
    raw = _read_config(root)
    rank, scaling, modules = _config_values(raw, max_rank)
    header = _read_header(root / WEIGHTS_FILE)
    shapes = module_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        match = KEY.fullmatch(name)
        if match is None:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r} is not a LoRA A/B weight of a "
                             f"decoder layer's {'/'.join(TARGET_MODULES)}")  # fmt: skip
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in modules:
            raise ValueError(
                f"{WEIGHTS_FILE}: tensor {name!r} targets {module!r}, "
                f"which is not in target_modules {list(modules)}"
            )
        if layer >= cfg.num_layers:
            raise ValueError(
                f"{WEIGHTS_FILE}: tensor {name!r} names layer {layer}; the model has "
                f"{cfg.num_layers}"
            )
        fan_in, fan_out = shapes[module]
        want = [rank, fan_in] if half == "A" else [fan_out, rank]
        if entry.get("dtype") not in FLOAT_DTYPES or entry.get("shape") != want:
            raise ValueError(
                f"{WEIGHTS_FILE}: tensor {name!r} is {entry.get('dtype')} "
                f"{entry.get('shape')}; expected a float tensor of shape {want}"
            )
        halves.setdefault((layer, module), {})[half] = name
    if not halves:
        raise ValueError(f"{WEIGHTS_FILE}: holds no LoRA weights")
    tensors = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise ValueError(f"{WEIGHTS_FILE}: layer {layer} {module} has no lora_{missing}")
        tensors[layer, module] = (pair["A"], pair["B"])
    return AdapterSpec(str(root), rank, scaling, modules, tensors)


def _read_config(root: Path) -> dict:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{CONFIG_FILE}: missing in {root}")
    try:
        raw = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{CONFIG_FILE}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{CONFIG_FILE}: must be a JSON object")
    return raw


def _config_values(raw: dict, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type {raw.get('peft_type')!r} is not LORA")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{CONFIG_FILE}: rank {rank} is above max_lora_rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    for key, ok in (
        ("use_dora", False),
        ("fan_in_fan_out", False),
        ("bias", "none"),
        ("modules_to_save", None),
        ("rank_pattern", {}),
        ("alpha_pattern", {}),
    ):
        value = raw.get(key, ok)
        if value != ok and value not in (None, [], {}):
            raise ValueError(f"{CONFIG_FILE}: {key}={value!r} is not supported")
    targets = raw.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGET_MODULES)
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{CONFIG_FILE}: target_modules must be a list of module names")
    for module in targets:
        if module not in TARGET_MODULES:
            raise ValueError(
                f"{CONFIG_FILE}: unknown target module {module!r}; the model's LoRA targets "
                f"are {', '.join(TARGET_MODULES)}"
            )
    scaling = alpha / (rank**0.5 if raw.get("use_rslora") else rank)
    return rank, float(scaling), tuple(targets)


def _read_header(file: Path) -> dict:
    """The safetensors header (name -> dtype, shape, data_offsets), bounds checked."""
    if not file.is_file():
        pickled = file.with_suffix(".bin")
        hint = f" ({pickled.name} is not read: pickle)" if pickled.exists() else ""
        raise ValueError(f"{WEIGHTS_FILE}: missing in {file.parent}{hint}")
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{WEIGHTS_FILE}: malformed (bad header length)")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{WEIGHTS_FILE}: malformed (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{WEIGHTS_FILE}: malformed (header is not an object)")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and offsets[1] <= size - 8 - n):
            raise ValueError(f"{WEIGHTS_FILE}: malformed (tensor {name!r} out of bounds)")
    return header


def load_adapter(spec: AdapterSpec) -> dict[tuple[int, str], tuple]:
    """The adapter's tensors in fp32 on the host: ``(layer, module) -> (A [r, in], B [out, r])``.
    ``ValueError`` when the file no longer matches its inspection."""
    import torch
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(str(Path(spec.path) / WEIGHTS_FILE), framework="pt") as f:
            for key, (a_name, b_name) in spec.tensors.items():
                a = f.get_tensor(a_name).to(torch.float32)
                b = f.get_tensor(b_name).to(torch.float32)
                if a.shape[0] != spec.rank or b.shape[1] != spec.rank:
                    raise ValueError(f"{WEIGHTS_FILE}: {a_name} changed since it was checked")
                out[key] = (a, b)
    except ValueError:
        raise
    except Exception as exc:  # the safetensors reader's own errors: a malformed file
        raise ValueError(f"{WEIGHTS_FILE}: malformed ({type(exc).__name__}: {exc})") from None
    return out
