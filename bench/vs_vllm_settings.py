"""What each engine is started with in ``bench/vs_vllm.py``: the two settings, and vLLM's
thread-binding variants (the bench keeps vLLM's better one per case).

- ``defaults``: each engine as a user starts it: the model, ``--dtype bfloat16``,
  ``--max-model-len 2048``, prefix caching, and nothing else: no thread variables, every
  other knob at the engine's own default (block size, batched-token budget, KV bytes,
  threads of each process, access log).
- ``matched``: the same block size (32, vLLM's CPU minimum), batched-token budget (2,048),
  sequences (256) and KV bytes (1 GiB) for both; threads still each engine's own choice
  (offline: ``OMP_NUM_THREADS`` for both, the bench's ``--threads``).

Each case runs per ``--presets`` checkpoint (``PRESETS``): the ``tiny`` make-model Llama, a
model where framework overhead is most of the step, and Llamas shaped like Qwen2.5-0.5B and
Llama-3.2-1B (``engine/serving_shapes.py``), where the matrix products are. The served cases
are the same for all three; offline the real shapes get 64 prompts x 128 in / 64 out
(``offline_workload``) so that one generate stays within minutes on a small CPU.

One exception to "defaults": vLLM's CPU build reserves 92 % of its NUMA node's memory by
default (``--gpu-memory-utilization 0.92``) and refuses to start when less is free, which on
this machine is always (12.8 GiB node, 11.5 free when idle); its error message tells the
user to pass ``--gpu-memory-utilization 0.5``, and so does the bench (``VLLM_DEFAULTS_FIX``).

vLLM's variants, all tried, the best kept per case and recorded: ``auto`` (its default:
binds its worker's OpenMP threads to the CPUs it picks, reserving some for other
processes), ``nobind`` (``OMP_NUM_THREADS`` threads, no pinning) and ``bind`` (one thread
pinned per CPU of the bench's CPU list).
"""

from __future__ import annotations

import os

SETTINGS = ("defaults", "matched")
PRESETS = ("tiny", "qwen2.5-0.5b", "llama3.2-1b")
MOE_PRESETS = ("tiny", "moe-0.6b")  # mixture-of-experts: --arch mixtral | qwen3_moe
ARCHS = ("llama", "mixtral", "qwen3_moe")
ALL_PRESETS = (*PRESETS, "moe-0.6b")


def presets(arch: str) -> tuple[str, ...]:
    """The presets a run of ``arch`` covers by default."""
    return PRESETS if arch == "llama" else MOE_PRESETS


USER_FLAGS = {"dtype": "bfloat16", "max_model_len": 2048, "enable_prefix_caching": True}
MATCHED = {"block_size": 32, "max_num_batched_tokens": 2048, "max_num_seqs": 256}
KV_BYTES = 1 << 30
VLLM_DEFAULTS_FIX = {"gpu_memory_utilization": 0.5}
# variables that would make "defaults" not the defaults: the bench's own shell may set them
STRIPPED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU")  # fmt: skip


def offline_workload(preset: str, quick: bool) -> dict[str, int]:
    """Prompts, input and output tokens of each offline generate of ``preset``."""
    if quick:
        prompts, inp, out = 16, 128, 32
    else:
        prompts, inp, out = (256, 128, 128) if preset == "tiny" else (64, 128, 64)
    return {"prompts": prompts, "input": inp, "output": out}


def engine_kwargs(setting: str, engine: str) -> dict:
    """``LLM(...)`` keyword arguments of ``engine`` in ``setting`` (offline)."""
    kw = dict(USER_FLAGS, seed=0)
    if setting == "matched":
        kw |= MATCHED
        kw["kv_cache_memory_bytes" if engine == "vllm" else "kv_cache_memory"] = KV_BYTES
    elif engine == "vllm":
        kw |= VLLM_DEFAULTS_FIX
    return kw


def serve_flags(setting: str, engine: str) -> list[str]:
    """``serve`` flags of ``engine`` in ``setting`` (after the model)."""
    flags = ["--served-model-name", "bench", "--dtype", "bfloat16", "--max-model-len", "2048"]
    flags += ["--enable-prefix-caching"]
    if setting == "matched":
        for key, value in MATCHED.items():
            flags += ["--" + key.replace("_", "-"), str(value)]
        kv = "--kv-cache-memory-bytes" if engine == "vllm" else "--kv-cache-memory"
        flags += [kv, str(KV_BYTES)]
    elif engine == "vllm":
        for key, value in VLLM_DEFAULTS_FIX.items():
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def base_env() -> dict[str, str]:
    """The bench's environment without thread or vLLM-CPU variables."""
    return {k: v for k, v in os.environ.items() if k not in STRIPPED}


def cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def variants(engine: str, threads: int | None, cpus: list[int]) -> dict[str, dict[str, str]]:
    """Name -> extra environment of each variant of ``engine``. ``threads`` None: as the user
    starts it (ours: nothing; vLLM: ``auto`` and ``nobind`` at torch's default threads);
    else that many OpenMP threads (vLLM: ``nobind`` and ``bind`` to the first ``threads``
    CPUs)."""
    if engine == "epdserve":
        return {"default": {} if threads is None else {"OMP_NUM_THREADS": str(threads)}}
    if threads is None:
        return {"auto": {}, "nobind": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}}
    omp = {"OMP_NUM_THREADS": str(threads)}
    return {
        "nobind": {**omp, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        "bind": {**omp, "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus[:threads])},
    }


def offline_cases(cpus: list[int], thread_counts: list[int]) -> list[tuple[str, int | None]]:
    """``(setting, threads)`` of the offline runs: defaults as started, then matched at
    each thread count asked for (capped at the CPUs there are)."""
    counts = sorted({min(t, len(cpus)) for t in thread_counts}, reverse=True)
    return [("defaults", None), *(("matched", t) for t in counts)]
