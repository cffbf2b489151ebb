"""Engine configuration: typed values, validated at construction with messages naming the field.

Every field declared with ``setting`` is also a flag of ``epdserve serve`` and an
``EPDSERVE_*`` variable (common/cli_fields.py). The connector and event configs are typed
objects; their JSON text (a flag, a variable, a string given to ``LLM(...)``) is parsed here,
once. The config reaches the engine-core process msgpack-encoded on stdin
(``encode_config``/``decode_config``), typed as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from epdserve.common.cli_fields import json_object, setting
from epdserve.connectors.ec_connector.config import ECTransferConfig
from epdserve.connectors.kv_connector.config import KVTransferConfig
from epdserve.connectors.kv_events.config import KVEventsConfig

DTYPES = ("float32", "bfloat16", "float16", "auto")  # auto: float32
CPU_BLOCK_SIZE = 128  # fewer blocks per step to map, hash and walk: 1.26-1.35x served on cpu
ROLES = ("both", "encoder", "prefill", "decode")
BACKENDS = ("triton", "native", "torch")
SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uni", "mp")  # vLLM's --scheduling-policy
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")  # models.quant.METHODS
# vLLM's --kv-cache-dtype values we take: auto is the model's dtype, fp8 is fp8_e4m3
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
KV_DTYPES = tuple(KV_CACHE_DTYPES)
ROLE_NEEDS = {"prefill": ("is_producer", "kv_producer"), "decode": ("is_consumer", "kv_consumer")}


@dataclass(frozen=True)
class EngineConfig:
    model: str = setting(help="model directory (HF format) or HuggingFace hub id", positional=True)
    dtype: str = setting("float32", "weights' and KV cache's dtype (auto: float32)", choices=DTYPES)
    device: str = setting("auto", "auto (cuda when torch sees one, else cpu), cpu or cuda[:N]")
    gpu_memory_utilization: float = setting(
        0.9,
        "share of the GPU's memory this engine may use; the KV cache gets what the "
        "weights and a profiled forward leave (--kv-cache-memory wins when given)",
    )
    block_size: int | None = setting(
        None, f"tokens per KV-cache block (default: {CPU_BLOCK_SIZE} on cpu, 16 on cuda)"
    )
    kv_cache_memory: int | None = setting(
        None, "bytes of KV cache (default: enough for --max-num-seqs, capped; on CUDA: profiled)"
    )
    kv_cache_dtype: str = setting(
        "auto", "KV cache storage: auto (--dtype), fp8 = fp8_e4m3 (scale 1.0)", choices=KV_DTYPES
    )
    max_num_seqs: int = setting(256, "most sequences running at once")
    max_num_batched_tokens: int | None = setting(
        None,
        "most tokens one step computes (default: 2048; on cpu down to 512 for large models, "
        "so a step's first tokens are not held back: engine/cpus.py)",
    )
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs: waiting requests start in arrival order; priority: by the request's "
        "priority field (lower first, ties by arrival), and when blocks run out the running "
        "request with the largest priority value is preempted",
        choices=SCHEDULING_POLICIES,
    )
    async_scheduling: bool | None = setting(None, "schedule the next step while the device runs "
        "this one (default: on for cuda; off on cpu, where it did not pay: docs/architecture.md)")  # fmt: skip
    stream_interval: int = setting(
        1,
        "a stream's tokens go out in chunks of this many (its first token and its end at "
        "once): larger chunks cost the API process less per token",
    )
    max_model_len: int | None = setting(None, "longest sequence (default: the model's)")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of a cached prefix")
    # connectors move every layer of a block together: a KV connector forces one group too
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "keep every layer's KV for the whole sequence (sliding-window layers included)"
    )
    prefix_caching_hash_algo: str = setting("sha256_cbor", "sha256_cbor, xxhash_cbor, blake3_cbor")
    hash_seed: str | None = setting(
        None, "roots the block-hash chain; pods that share a store or a router share one"
    )
    seed: int = setting(0, "torch's seed")
    enable_kv_events: bool = False  # on when kv_events_config is active
    kv_events_config: KVEventsConfig | None = setting(None, "vLLM's --kv-events-config JSON")
    kv_events_curve_dir: str | None = setting(
        None,
        "CurveZMQ keys for the KV-event sockets: a directory with server.public, "
        "server.secret and client.public (Z85; the routers' keys, one per line)",
    )
    kv_transfer_config: KVTransferConfig | None = setting(
        None, "vLLM's --kv-transfer-config JSON: the KV connector and its role"
    )
    role: str = setting("both", "which part of the model this pod runs", choices=ROLES)
    ec_transfer_config: ECTransferConfig | None = setting(
        None, "the encoder-cache connector and its role, as JSON"
    )
    mm_processor_kwargs: dict | None = setting(
        None, "image-processor options as JSON, e.g. '{\"do_pan_and_scan\": true}'"
    )
    attention_backend: str | None = setting(
        None,
        "attention kernels; default: triton on cuda, native (C decode) or torch on cpu",
        choices=BACKENDS,
    )
    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT directories) over the model")
    lora_modules: list[str] = setting(
        [],
        "an adapter served from the start: name=path or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (repeat the flag; the '
        "variable takes space-separated name=path items)",
        repeat=True,
    )
    max_loras: int = setting(1, "adapters on device slots at once (one batch mixes up to this)")
    max_lora_rank: int = setting(16, "highest adapter rank accepted (slots are this wide)")
    max_cpu_loras: int | None = setting(
        None, "adapters kept read in host memory (default: --max-loras)"
    )
    allow_runtime_lora_updating: bool = setting(
        False,
        "enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(VLLM_ALLOW_RUNTIME_LORA_UPDATING=true also turns this on)",
    )
    tensor_parallel_size: int = setting(
        1, "ranks the model is sharded over (a worker process each; DESIGN.md §10)", short="-tp"
    )
    distributed_executor_backend: str | None = setting(
        None,
        "uni: one worker in the core's process; mp: a worker process per rank "
        "(default: uni at --tensor-parallel-size 1, mp above)",
        choices=EXECUTOR_BACKENDS,
    )
    quantization: str | None = setting(
        None,
        "the checkpoint's weight quantization: fp8, compressed-tensors, gptq or awq (default: "
        "its config.json quantization_config decides; a value that contradicts it is refused)",
        choices=QUANTIZATION_METHODS,
    )
    # the checkpoint's content digest, read once at start (kv_transfer/setup.resolve_identity)
    model_digest: str | None = None

    def __post_init__(self) -> None:
        self._parse_text()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", "float32")
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.block_size is None:  # measured on cpu: docs/performance.md, "Defaults"
            size = CPU_BLOCK_SIZE if self.device == "cpu" else 16
            object.__setattr__(self, "block_size", size)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "stream_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy: must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        if self.kv_events_config is not None and self.kv_events_config.active:
            object.__setattr__(self, "enable_kv_events", True)
        if self.kv_events_curve_dir:  # a missing or bad key file fails the start, named
            from epdserve.connectors.kv_events import CurveServerKeys

            CurveServerKeys.load(self.kv_events_curve_dir)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be positive bytes, got {self.kv_cache_memory}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")  # fmt: skip
        if self.mm_processor_kwargs is not None:
            from epdserve.engine.inputs.image_processor import check_processor_kwargs

            check_processor_kwargs(self.mm_processor_kwargs)
        if self.attention_backend is not None:
            from epdserve.kernels.backends import check_backend

            check_backend(self.attention_backend, self.device)
        self._check_role()
        self._check_parallel()
        self._check_quantization()
        from epdserve.engine.lora.settings import check_lora_settings

        check_lora_settings(self)

    @property
    def kv_storage_dtype(self) -> str:
        """The torch dtype name of the stored KV cache (``float8_e4m3fn``, or ``dtype``)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    def _parse_text(self) -> None:
        """The settings given as JSON text (a flag, a variable) or a dict, typed: the edge."""
        for name, parse in (
            ("kv_events_config", KVEventsConfig.parse),
            ("kv_transfer_config", KVTransferConfig.parse),
            ("ec_transfer_config", ECTransferConfig.parse),
        ):
            object.__setattr__(self, name, parse(getattr(self, name)))
        if isinstance(self.mm_processor_kwargs, str):
            kwargs = json_object(self.mm_processor_kwargs, "mm_processor_kwargs")
            object.__setattr__(self, "mm_processor_kwargs", kwargs)

    def _check_parallel(self) -> None:
        tp, backend = self.tensor_parallel_size, self.distributed_executor_backend
        if tp < 1:
            raise ValueError(f"tensor_parallel_size: must be at least 1, got {tp}")
        if tp > 1 and self.role == "encoder":
            raise ValueError(
                f"tensor_parallel_size: an encoder pod runs the vision encoder alone, on one "
                f"device; got {tp}"
            )
        if tp > 1 and os.path.isfile(os.path.join(self.model, "config.json")):
            from epdserve.engine.models.config import load_model_config
            from epdserve.engine.models.layers import check_tensor_parallel

            check_tensor_parallel(load_model_config(self.model), tp)  # before any process starts
        if backend is None:
            object.__setattr__(self, "distributed_executor_backend", "uni" if tp == 1 else "mp")
        elif backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend: must be uni or mp, got {backend!r}")
        elif backend == "uni" and tp > 1:
            raise ValueError(
                f"distributed_executor_backend: uni runs one rank; --tensor-parallel-size {tp} "
                "needs mp"
            )

    def _check_quantization(self) -> None:
        """A flag that contradicts the checkpoint fails the start, before any process."""
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )
        if os.path.isfile(os.path.join(self.model, "config.json")):
            from epdserve.engine.models.config import load_model_config
            from epdserve.engine.models.quant import for_model

            for_model(load_model_config(self.model), self.quantization)

    def _check_role(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        ec = self.ec_transfer_config
        if self.role == "encoder" and (ec is None or not ec.is_producer):
            raise ValueError(
                "ec_transfer_config: role encoder needs an encoder-cache "
                "connector with ec_role ec_producer or ec_both"
            )
        if self.role in ROLE_NEEDS:
            attr, kv_role = ROLE_NEEDS[self.role]
            transfer = self.kv_transfer_config
            if transfer is None or not getattr(transfer, attr):
                raise ValueError(
                    f"kv_transfer_config: role {self.role} needs a KV connector with kv_role "
                    f"{kv_role} or kv_both"
                )


def encode_config(config: EngineConfig) -> bytes:
    """The config as the engine-core process reads it on stdin (msgpack, typed fields)."""
    return msgspec.msgpack.encode(config)


def decode_config(data: bytes) -> EngineConfig:
    """``encode_config``'s bytes back to the config (its checks run again; nothing re-parsed)."""
    return msgspec.msgpack.decode(data, type=EngineConfig)


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
