"""The worker half of LoRA: the device slots the decoder reads, written when the scheduler half
places an adapter.

The scheduler half (``manager.LoRAManager``) reads adapter files, keeps them on the host and
decides which adapter sits on which slot; each placement crosses the executor as a
``LoRASlotLoad`` (fp32 bytes, msgpack-able, so a worker in another process gets the same
message). A worker copies it into its stacks: ``stacks[layer][module] = (A [S, r_max, in],
B [S, out, r_max])`` and ``scaling [S]``, allocated once; slot ``s`` of every stack holds one
adapter, zero-padded to ``max_lora_rank`` and zero where the adapter has no weights.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from epdserve.engine.lora.peft_files import TARGET_MODULES, module_shapes
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.layers import Shard, shard_config


class LoRAModuleWeights(msgspec.Struct, array_like=True):
    """One target module of one layer: ``A [rank, in]`` and ``B [out, rank]``, fp32 bytes."""

    layer: int
    module: str
    rank: int
    a: bytes
    b: bytes


class LoRASlotLoad(msgspec.Struct, array_like=True):
    """Put adapter ``lora_int_id`` on device slot ``slot`` of every worker."""

    slot: int
    lora_int_id: int
    scaling: float
    modules: list[LoRAModuleWeights]


def encode_weights(weights: dict[tuple[int, str], tuple]) -> list[LoRAModuleWeights]:
    """``(layer, module) -> (A, B)`` host tensors (``peft_files.load_adapter``) as bytes."""
    out = []
    for (layer, module), (a, b) in sorted(weights.items()):
        a32 = a.to(torch.float32).contiguous().numpy()
        b32 = b.to(torch.float32).contiguous().numpy()
        out.append(LoRAModuleWeights(layer, module, a32.shape[0], a32.tobytes(), b32.tobytes()))
    return out


def _tensor(data: bytes, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(rows, -1).copy())


def lora_slices(cfg: ModelConfig, shard: Shard) -> dict[str, tuple[str, int, int]]:
    """module -> (``"a"`` columns | ``"b"`` rows, start, end) of a rank's slice (none at TP 1)."""
    if shard.size == 1:
        return {}
    d = cfg.head_dim
    q0, q1 = shard.split(cfg.num_heads)
    kv0, kvn = shard.kv_heads(cfg.num_kv_heads)
    i0, i1 = shard.split(cfg.intermediate_size)
    kv = ("b", kv0 * d, (kv0 + kvn) * d)
    return {
        "q_proj": ("b", q0 * d, q1 * d),
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": ("a", q0 * d, q1 * d),
        "gate_proj": ("b", i0, i1),
        "up_proj": ("b", i0, i1),
        "down_proj": ("a", i0, i1),
    }


class LoRASlots:
    """A worker's adapter stacks on its device (the model runner hands them to the decoder
    through ``LoRABatch``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        shard: Shard | None = None,
    ):
        """``cfg``: the whole model's; under a tensor-parallel ``shard`` the stacks hold this
        rank's slice of each adapter, as ``models.layers`` slices the base weights: B's rows
        of the column-parallel modules, A's columns of the row-parallel ones (o, down)."""
        shard = shard or Shard()
        self.slices = lora_slices(cfg, shard)
        shapes = module_shapes(shard_config(cfg, shard))
        self.max_rank = max_rank
        self.stacks = [
            {
                m: (
                    torch.zeros(max_loras, max_rank, shapes[m][0], dtype=dtype, device=device),
                    torch.zeros(max_loras, shapes[m][1], max_rank, dtype=dtype, device=device),
                )
                for m in TARGET_MODULES
            }
            for _ in range(cfg.num_layers)
        ]
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.num_slot_writes = 0

    def load(self, load: LoRASlotLoad) -> None:
        """Overwrite slot ``load.slot`` with the adapter's weights (zeros where it has none)."""
        slot = load.slot
        assert 0 <= slot < len(self.scaling), f"LoRA slot {slot} of {len(self.scaling)}"
        weights = {(m.layer, m.module): m for m in load.modules}
        for layer, stacks in enumerate(self.stacks):
            for module, (a_stack, b_stack) in stacks.items():
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                m = weights.get((layer, module))
                if m is not None:
                    assert m.rank <= self.max_rank, f"LoRA rank {m.rank} > {self.max_rank}"
                    a, b = _tensor(m.a, m.rank), _tensor(m.b, len(m.b) // (4 * m.rank))
                    if module in self.slices:
                        which, start, end = self.slices[module]
                        a, b = (a[:, start:end], b) if which == "a" else (a, b[start:end])
                    a_stack[slot, : m.rank].copy_(a)
                    b_stack[slot, :, : m.rank].copy_(b)
        self.scaling[slot] = load.scaling
        self.num_slot_writes += 1

    def clear(self, slot: int) -> None:
        """Slot ``slot`` holds no adapter any more: a zero scaling adds nothing if read."""
        self.scaling[slot] = 0.0
