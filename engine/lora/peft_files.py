"""A PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``), read and
checked against the base model: the edge where an adapter's files become typed values.

``inspect_adapter`` reads the config and the safetensors header only (no torch, no tensor
bytes), so the API process can refuse a bad adapter at load with a message naming the
problem; ``load_adapter`` then reads the tensors (the engine core, off its step loop).
Pickled weights (``adapter_model.bin``) are never read.
"""

from __future__ import annotations

import io
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from epdserve.engine.lora.safetensors_header import clip as _clip
from epdserve.engine.lora.safetensors_header import parse_json as _parse_json
from epdserve.engine.lora.safetensors_header import read_header
from epdserve.engine.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FLOAT_DTYPES = ("F32", "F16", "BF16")
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes about 1 KiB; a bigger file is refused unread
MAX_CONFIG_DEPTH = 16  # PEFT's fields nest 3 deep
# the text decoder's layers under the prefixes PEFT gives them (causal LM, Gemma3 image+text);
# a layer number has at most 9 digits (int() of a 5,000-digit one would itself fail)
KEY = re.compile(
    r"base_model\.model\.(?:model\.|model\.language_model\.|language_model\.model\.)"
    r"layers\.(\d{1,9})\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
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
    (an unusable path, a missing or malformed file and the part of it, rank above
    ``max_rank``, unknown target module, a tensor of the wrong shape or name)."""
    try:
        return _inspect(Path(path), cfg, max_rank)
    except OSError as exc:  # a name too long, a loop of links, no permission, a read error
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"lora_path: {_clip(str(path))} cannot be read ({reason})") from None


def _inspect(root: Path, cfg: ModelConfig, max_rank: int) -> AdapterSpec:
    if not root.is_dir():
        raise ValueError(f"lora_path: {_clip(str(root))} is not a directory")
    raw = _read_config(root)
    rank, scaling, modules = _config_values(raw, max_rank)
    header = _read_header(root / WEIGHTS_FILE)
    tensors = _lora_tensors(header, cfg, rank, modules)
    return AdapterSpec(str(root), rank, scaling, modules, tensors)


def _lora_tensors(
    header: dict, cfg: ModelConfig, rank: int, modules: tuple[str, ...]
) -> dict[tuple[int, str], tuple[str, str]]:
    """The A and B tensor names per ``(layer, module)``, each checked against the model."""
    shapes = module_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        match = KEY.fullmatch(name)
        if match is None:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {_clip(repr(name))} is not a LoRA A/B "
                             f"weight of a decoder layer's {'/'.join(TARGET_MODULES)}")  # fmt: skip
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
        if entry["dtype"] not in FLOAT_DTYPES or entry["shape"] != want:
            raise ValueError(
                f"{WEIGHTS_FILE}: tensor {name!r} is {entry['dtype']} "
                f"{_clip(str(entry['shape']))}; expected a float tensor of shape {want}"
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
    return tensors


def _read_config(root: Path) -> dict:
    """``adapter_config.json`` as a dict: at most ``MAX_CONFIG_BYTES`` are read (a bigger
    file is refused, so a huge one costs no memory) and nesting is bounded before parsing."""
    with open_regular(root / CONFIG_FILE) as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{CONFIG_FILE}: larger than {MAX_CONFIG_BYTES} bytes")
    raw = _parse_json(data, CONFIG_FILE, MAX_CONFIG_DEPTH)
    if not isinstance(raw, dict):
        raise ValueError(f"{CONFIG_FILE}: must be a JSON object")
    return raw


def _config_values(raw: dict, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(
            f"{CONFIG_FILE}: peft_type {_clip(repr(raw.get('peft_type')))} is not LORA"
        )
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{CONFIG_FILE}: r must be a positive integer, got {_clip(repr(rank))}")
    if rank > max_rank:
        raise ValueError(
            f"{CONFIG_FILE}: rank {_clip(str(rank))} is above max_lora_rank {max_rank}"
        )
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not _finite(alpha):
        raise ValueError(
            f"{CONFIG_FILE}: lora_alpha must be a finite number, got {_clip(repr(alpha))}"
        )
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
            raise ValueError(f"{CONFIG_FILE}: {key}={_clip(repr(value))} is not supported")
    targets = raw.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGET_MODULES)
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{CONFIG_FILE}: target_modules must be a list of module names")
    for module in targets:
        if module not in TARGET_MODULES:
            raise ValueError(
                f"{CONFIG_FILE}: unknown target module {_clip(repr(module))}; the model's LoRA "
                f"targets are {', '.join(TARGET_MODULES)}"
            )
    scaling = alpha / (rank**0.5 if raw.get("use_rslora") else rank)
    return rank, float(scaling), tuple(targets)


def _read_header(file: Path) -> dict:
    """The safetensors header (name -> dtype, shape, data_offsets), checked by safetensors'
    rules (``safetensors_header``)."""
    if not file.exists():
        pickled = file.with_suffix(".bin")
        hint = f" ({pickled.name} is not read: pickle)" if pickled.exists() else ""
        raise ValueError(f"{WEIGHTS_FILE}: missing in {_clip(str(file.parent))}{hint}")
    with open_regular(file) as f:
        return read_header(f, os.fstat(f.fileno()).st_size, WEIGHTS_FILE)


def open_regular(file: Path) -> BinaryIO:
    """``file`` open for reading, refused unless it is a regular file (a FIFO would block
    the read, and the LoRA lock, forever; a device such as /dev/zero never ends)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{file.name}: missing in {_clip(str(file.parent))}") from None
    except OSError as exc:
        raise ValueError(f"{file.name}: cannot be opened ({exc.strerror})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ValueError(f"{file.name}: not a regular file")
    return f


def _finite(number: int | float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int past float's range
        return False


def load_adapter(spec: AdapterSpec, data: bytes) -> dict[tuple[int, str], tuple]:
    """The adapter's tensors in fp32 on the host, from ``data`` (the weights file's bytes, as
    read and digested by the caller): ``(layer, module) -> (A [r, in], B [out, r])``.
    ``ValueError`` when the bytes no longer match the inspection."""
    import torch
    from safetensors.torch import load

    read_header(io.BytesIO(data), len(data), WEIGHTS_FILE)  # the checks of the inspection
    out = {}
    try:
        tensors = load(data)
        for key, (a_name, b_name) in spec.tensors.items():
            a, b = tensors.get(a_name), tensors.get(b_name)
            if a is None or b is None or a.shape[0] != spec.rank or b.shape[1] != spec.rank:
                raise ValueError(f"{WEIGHTS_FILE}: {a_name} changed since it was checked")
            out[key] = (a.to(torch.float32), b.to(torch.float32))
    except ValueError:
        raise
    except Exception as exc:  # the safetensors reader's own errors: a malformed file
        raise ValueError(f"{WEIGHTS_FILE}: malformed ({type(exc).__name__}: {exc})") from None
    return out
