"""Engine configuration: plain values, validated at construction with messages naming the field."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
ROLES = ("both", "encoder", "prefill", "decode")
ROLE_NEEDS = {"prefill": ("is_producer", "kv_producer"), "decode": ("is_consumer", "kv_consumer")}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "auto"  # cpu | cuda[:N] | auto (cuda when torch sees one, else cpu)
    gpu_memory_utilization: float = 0.9  # share of the GPU this engine may use (KV sizing)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: enough for max_num_seqs (capped)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # one KV-cache group for all layers (also forced when a KV connector is configured:
    # connectors move every layer of a block together)
    disable_hybrid_kv_cache_manager: bool = False
    prefix_caching_hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None
    seed: int = 0
    enable_kv_events: bool = False
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON
    kv_events_curve_dir: str | None = None  # CurveZMQ keys of the event sockets (a directory)
    kv_transfer_config: str | None = None  # vLLM's --kv-transfer-config JSON
    role: str = "both"  # both | encoder | prefill | decode (DESIGN.md §2)
    ec_transfer_config: str | None = None  # --ec-transfer-config JSON (encoder outputs)
    mm_processor_kwargs: dict | None = None  # image-processor options, e.g. do_pan_and_scan
    attention_backend: str | None = None  # triton | native | torch; None: chosen by device

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "device", resolve_device(self.device))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        if self.kv_events_config:
            from epdserve.connectors.kv_events import KVEventsConfig

            if KVEventsConfig.from_json(self.kv_events_config).active:
                object.__setattr__(self, "enable_kv_events", True)
        if self.kv_events_curve_dir:  # a missing or bad key file fails the start, named
            from epdserve.connectors.kv_events import CurveServerKeys

            CurveServerKeys.load(self.kv_events_curve_dir)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be positive bytes, got {self.kv_cache_memory}")
        if self.mm_processor_kwargs is not None:
            from epdserve.engine.inputs.processor import check_processor_kwargs

            check_processor_kwargs(self.mm_processor_kwargs)
        if self.attention_backend is not None:
            from epdserve.kernels.backends import check_backend

            check_backend(self.attention_backend, self.device)
        self._check_role()

    def _check_role(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        transfer = None
        if self.kv_transfer_config:
            from epdserve.connectors.kv_connector import KVTransferConfig

            transfer = KVTransferConfig.from_json(self.kv_transfer_config)
        if self.ec_transfer_config or self.role == "encoder":
            from epdserve.connectors.ec_connector import ECTransferConfig

            ec = (
                ECTransferConfig.from_json(self.ec_transfer_config)
                if self.ec_transfer_config
                else None
            )
            if self.role == "encoder" and (ec is None or not ec.is_producer):
                raise ValueError(
                    "ec_transfer_config: role encoder needs an encoder-cache "
                    "connector with ec_role ec_producer or ec_both"
                )
        if self.role in ROLE_NEEDS:
            attr, kv_role = ROLE_NEEDS[self.role]
            if transfer is None or not getattr(transfer, attr):
                raise ValueError(
                    f"kv_transfer_config: role {self.role} needs a KV connector with kv_role "
                    f"{kv_role} or kv_both"
                )


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a CUDA device, else ``cpu``; ``cuda[:N]`` must
    exist here, so a pod asked for a GPU it does not have fails at start, naming why."""
    if device == "cpu":
        return device
    if device != "auto" and device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"device: must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    import torch

    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if not available:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        raise ValueError(
            f"device: {device} was asked for, but torch sees no CUDA device (torch "
            f"{torch.__version__}, {build}); use --device cpu or run where a GPU is visible"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device: {device} does not exist ({torch.cuda.device_count()} CUDA device(s) here)"
        )
    return device
