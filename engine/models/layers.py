"""Tensor-parallel layers (DESIGN.md §10), as vLLM shards a decoder:

- column-parallel q/k/v and gate/up: a rank holds its heads' (its KV heads') rows and its
  share of the intermediate rows; attention and the activation need no communication;
- row-parallel o and down: a rank holds the matching columns, and the partial sums are
  all-reduced (``TPGroup.all_reduce``) after the product (and after a LoRA delta, which is
  linear in the same slice);
- vocab-parallel embedding and LM head: a rank holds ``ceil(V / tp)`` rows of the vocabulary
  (the last padded with zero rows); an embedding is looked up where its row lives and
  all-reduced, and the logits are gathered on the output rank.

KV heads are split when there are at least as many as ranks, else replicated: rank ``r``
keeps KV head ``r // (tp / kv_heads)``. Each rank reads only its slice of each weight from the
checkpoint (``ShardedWeights``: safetensors slices); at TP 1 every read is the whole tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from epdserve.engine.models.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's even share of ``n`` (``size`` divides ``n``)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """``(first, count)`` of the KV heads this rank keeps (replicated past their count)."""
        if num_kv_heads >= self.size:
            per = num_kv_heads // self.size
            return self.rank * per, per
        return self.rank // (self.size // num_kv_heads), 1

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """``(start, rows)``: this rank's vocabulary rows (every rank holds ``rows``, padded)."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Refuse a TP size the model cannot be split by (``ValueError`` naming the flag)."""
    from epdserve.engine.models.moe_weights import check_moe_tensor_parallel

    check_moe_tensor_parallel(cfg, tp)  # the experts' intermediate sizes
    kv = cfg.num_kv_heads
    why = None
    if cfg.num_heads % tp:
        why = f"the model's {cfg.num_heads} attention heads"
    elif kv % tp and tp % kv:
        why = f"the model's {kv} KV heads (nor do they divide it)"
    elif cfg.intermediate_size % tp:
        why = f"the model's intermediate size {cfg.intermediate_size}"
    else:
        why = _split_groups(cfg, tp)
    if why is not None:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide {why}")


def _split_groups(cfg: ModelConfig, tp: int) -> str | None:
    """Why a row-parallel slice at ``tp`` would split a quantization group (None: it won't)."""
    from epdserve.engine.models.quant import input_group

    group = input_group(cfg.quantization)
    for what, k in (("attention width", cfg.q_size), ("intermediate size", cfg.intermediate_size)):
        if group and (k // tp) % group:
            return (
                f"the model's {what} {k} into whole quantization groups of {group} input "
                f"columns (a rank's slice would hold {k // tp})"
            )
    return None


def shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's slice: its heads, KV heads and intermediate size."""
    if shard.size == 1:
        return cfg
    return replace(
        cfg,
        num_heads=cfg.num_heads // shard.size,
        num_kv_heads=shard.kv_heads(cfg.num_kv_heads)[1],
        intermediate_size=cfg.intermediate_size // shard.size,
    )


class PlainReader:
    """A checkpoint reader that refuses to hand out an fp8 tensor as a plain one."""

    def __init__(self, reader):
        self.inner = reader
        self.has, self.names = reader.has, reader.names

    def _check(self, name: str) -> None:
        if self.inner.has(name) and self.inner.get_slice(name).get_dtype() == "F8_E4M3":
            raise ValueError(
                f"model: tensor {name!r} is stored quantized (fp8) but was read as a plain "
                "tensor: this architecture's loader does not read that layer quantized"
            )

    def get(self, name: str) -> torch.Tensor:
        self._check(name)
        return self.inner.get(name)

    def get_slice(self, name: str):
        self._check(name)
        return self.inner.get_slice(name)


class ShardedWeights:
    """This rank's slice of each checkpoint tensor, on the device in the model dtype.
    ``reader`` is a ``loader.CheckpointReader``; names are given without ``prefix``.

    With a ``quant`` method (``models.quant``), a linear layer's ``...proj.weight`` that the
    checkpoint holds quantized comes back as a ``kernels.quant_linear`` weight, sliced the
    same way (row-parallel slices must be whole quantization groups)."""

    def __init__(
        self, reader, prefix: str, cfg: ModelConfig, shard: Shard, dtype, device, quant=None
    ):
        self.prefix, self.cfg, self.shard = prefix, cfg, shard
        self.dtype, self.device, self.quant = dtype, device, quant
        # what architectures read directly refuses fp8 tensors: read plain, they lose their scale
        self.raw, self.reader = reader, reader if quant is None else PlainReader(reader)

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def _quantized(self, name: str, rows=None, cols=None):
        """The quantized weight of ``name`` (rows / cols: ``[start, end)``), or None where
        ``name`` is not a weight the checkpoint holds quantized."""
        if self.quant is None or not name.endswith(".weight"):
            return None
        base = self.prefix + name[: -len(".weight")]
        if not self.quant.quantizes(self.raw, base):
            return None
        from epdserve.engine.models.quant import on_device
        from epdserve.kernels.quant_linear import slice_rows

        w = self.quant.read(self.raw, base, cols, self.dtype)
        return on_device(w if rows is None else slice_rows(w, *rows), self.device)

    def _rows(self, name: str, start: int, end: int) -> torch.Tensor:
        if self.shard.size == 1:
            return self.reader.get(self.prefix + name)
        return self.reader.get_slice(self.prefix + name)[start:end]

    def _row_slice(self, name: str, start: int, end: int):
        """Rows ``start..end`` of ``name`` on the device: quantized where the checkpoint is."""
        rows = None if self.shard.size == 1 else (start, end)
        quantized = self._quantized(name, rows=rows)
        return quantized if quantized is not None else self._to(self._rows(name, start, end))

    def full(self, name: str) -> torch.Tensor:
        quantized = self._quantized(name)
        return quantized if quantized is not None else self._to(self.reader.get(self.prefix + name))

    def fused_rows(self, name: str, spans: list[tuple[int, int]]):
        """The row spans ``[start, end)`` of a checkpoint's fused tensor (Phi-3's ``qkv_proj``),
        one after the other; quantized where the checkpoint is."""
        quantized = self._quantized(name)
        if quantized is not None:
            from epdserve.kernels.quant_linear import slice_rows

            return torch.cat([slice_rows(quantized, start, end) for start, end in spans])
        lazy = self.reader.get_slice(self.prefix + name)
        return self._to(torch.cat([lazy[start:end] for start, end in spans]))

    def norm(self, name: str) -> torch.Tensor:
        """Gemma's ``1 + w`` norm weight, kept in fp32."""
        return (1.0 + self.reader.get(self.prefix + name).float()).to(self.device).contiguous()

    def q(self, name: str) -> torch.Tensor:
        """This rank's query heads' rows (a weight or a bias)."""
        d = self.cfg.head_dim
        start, end = self.shard.split(self.cfg.num_heads)
        return self._row_slice(name, start * d, end * d)

    def kv(self, name: str) -> torch.Tensor:
        """This rank's KV heads' rows."""
        d = self.cfg.head_dim
        first, count = self.shard.kv_heads(self.cfg.num_kv_heads)
        return self._row_slice(name, first * d, (first + count) * d)

    def qkv(self, attn: str, kind: str = "weight") -> torch.Tensor:
        """Fused q|k|v of this rank (``attn``: the layer's ``...self_attn.`` prefix)."""
        q = self.q(f"{attn}q_proj.{kind}")
        return torch.cat([q, self.kv(f"{attn}k_proj.{kind}"), self.kv(f"{attn}v_proj.{kind}")])

    def column(self, name: str) -> torch.Tensor:
        """Column-parallel: an even share of the output rows (gate, up)."""
        n = self.cfg.intermediate_size
        return self._row_slice(name, *self.shard.split(n))

    def row(self, name: str, in_features: int) -> torch.Tensor:
        """Row-parallel: an even share of the input columns (o, down)."""
        cols = None if self.shard.size == 1 else self.shard.split(in_features)
        quantized = self._quantized(name, cols=cols)
        if quantized is not None:
            return quantized
        if self.shard.size == 1:
            return self.full(name)
        start, end = cols
        return self._to(self.reader.get_slice(self.prefix + name)[:, start:end])

    def vocab(self, name: str) -> torch.Tensor:
        """Vocab-parallel: this rank's rows of an embedding or LM head, zero-padded."""
        if self.shard.size == 1:
            return self.full(name)
        v = self.cfg.vocab_size
        start, rows = self.shard.vocab(v)
        end = min(start + rows, v)
        t = self.reader.get_slice(self.prefix + name)[start:end] if end > start else None
        out = torch.zeros(rows, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        if t is not None:
            out[: end - start] = t.to(device=self.device, dtype=self.dtype)
        return out


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int, tp) -> torch.Tensor:
    """Embeddings of ``ids`` from a vocab-parallel table (rows ``start``..): looked up where
    they live, zero elsewhere, then summed over the ranks."""
    if tp.size == 1:
        return F.embedding(ids, weight)
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside.unsqueeze(-1), 0)
    return tp.all_reduce(out)


def gathered_logits(local: torch.Tensor, vocab_size: int, tp) -> torch.Tensor | None:
    """The full ``[T, V]`` logits on the output rank from each rank's vocab slice; None on
    the others."""
    if tp.size == 1:
        return local
    full = tp.gather_last(local)
    return None if full is None else full[:, :vocab_size]


def inference(fn):
    """``torch.inference_mode()`` around ``fn``, entered only when its caller is not in it
    already: the runner's step is, and a nested entry (a new context object, cloned, entered
    and left) cost several µs a call at cold caches, three calls a step."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run
