"""Host time per decode step on a 1-layer model (issue #39's CPU measure; prints JSON).

On a 1-layer tiny llama (bf16) the model's own work is small, so a decode step's time is
mostly host work: scheduling, building the step's inputs, sampling, updating requests. Two
measurements, each engine alone:

- ``phases_us`` (ours): mean microseconds per decode step of each phase, timed by wrapping
  the calls ``EngineCore.step`` makes (schedule; the runner's state update, input prepare,
  device move, model forward, logits, sampling; the scheduler's update), at each batch size.
  ``other`` is the step minus those phases (the executor seam, structured-output fill,
  connector hooks, the loop itself); ``host`` is the step minus the forward and the logits.
  Each figure is the median of ``--rounds`` runs.
- ``step_ms`` (side by side with vLLM): each engine's offline ``LLM.generate`` of ``batch``
  prompts of 8 tokens to 1 and to ``--steps + 1`` output tokens (``ignore_eos``); the
  difference over ``--steps`` is the time of one decode step of the whole batch. Both at the
  matched settings of ``bench/vs_vllm.py`` (block 32, 2,048 batched tokens, 256 sequences,
  1 GiB KV), threads as each starts by default; medians of ``--rounds``.
- ``attention_layer_us`` (ours): one layer's decode attention call with and without the
  step's shared geometry (``AttentionMetadata.step_cache``): the host time each layer after
  the first saves, which a 1-layer model cannot show.

    .venv/bin/python bench/step_host_time.py [--batches 1,64,256] [--steps 32] [--rounds 3]
        [--no-vllm] [--vllm-venv DIR] [--dtype bfloat16|float32] [--phases-only]

    PYTHONPATH=/tmp/before .venv/bin/python bench/step_host_time.py --phases-only ...
        # the same phases of another commit: /tmp/before/epdserve a worktree of it
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT_LEN = 8


def one_layer_checkpoint(out: Path) -> Path:
    """The tiny llama preset in bf16, cut to its first decoder layer."""
    from safetensors.torch import load_file, save_file
    from vs_vllm_env import make_checkpoint

    path = make_checkpoint(out, "tiny")
    weights = path / "model.safetensors"
    kept = {
        k: v
        for k, v in load_file(weights).items()
        if not k.startswith("model.layers.") or k.startswith("model.layers.0.")
    }
    save_file(kept, weights, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


class Phases:
    """Wall time of wrapped calls, accumulated by phase name."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)


def phase_breakdown(model: Path, batch: int, steps: int, dtype: str = "bfloat16") -> dict:
    """Mean µs per decode step of each phase, ``batch`` requests decoding together. Runs on
    the code before #39 too (``PYTHONPATH`` at a worktree of it), for a before and after."""
    from vs_vllm_settings import KV_BYTES, MATCHED

    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
    from epdserve.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(model), max_model_len=512, kv_cache_memory=KV_BYTES, dtype=dtype, **MATCHED
    )
    core = EngineCore(config)
    try:
        runner = core.executor.worker.runner
        phases = Phases()
        phases.wrap(core.scheduler, "schedule", "schedule")
        phases.wrap(runner, "_update_states", "runner state update")
        phases.wrap(runner.batch, "prepare", "input prepare")
        phases.wrap(runner.device_inputs, "move", "device move")
        phases.wrap(runner.model, "forward", "model forward")
        phases.wrap(runner.model, "compute_logits", "logits")
        if hasattr(runner, "sampler"):
            phases.wrap(runner.sampler, "sample", "sample")
        else:  # the runner before #39 sampled in a method of its own
            phases.wrap(runner, "_sample", "sample")
        phases.wrap(core.scheduler, "update_from_output", "scheduler update")
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            prompt = [10 + i % 3000, *range(11, 10 + PROMPT_LEN)]
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
            core.step()  # prefill (and a first token) for every request
        phases.seconds.clear()
        total = 0.0
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            total += time.perf_counter() - t
    finally:
        core.close()
    out = {name: round(s / steps * 1e6, 1) for name, s in phases.seconds.items()}
    out["other"] = round((total - sum(phases.seconds.values())) / steps * 1e6, 1)
    out["step"] = round(total / steps * 1e6, 1)
    return out


def median_phases(model: Path, batch: int, steps: int, dtype: str, rounds: int) -> dict:
    """Each phase's median over ``rounds`` runs, and ``host``: the step less the forward and
    the logits (the matrix products)."""
    runs = [phase_breakdown(model, batch, steps, dtype) for _ in range(rounds)]
    out = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
    out["host"] = round(out["step"] - out["model forward"] - out["logits"], 1)
    return out


def step_ms(python: str, engine: str, model: Path, batches, steps: int, rounds: int) -> dict:
    """Per-step ms of one engine's offline generate at each batch (see the docstring)."""
    from vs_vllm import OfflineWorker
    from vs_vllm_settings import base_env, engine_kwargs, variants

    env = base_env() | next(iter(variants(engine, None, []).values()))
    worker = OfflineWorker(python, engine, model, engine_kwargs("matched", engine), env)
    out = {}
    try:
        for batch in batches:
            per_step = []
            for r in range(rounds):
                cmd = {"seed": r, "prompts": batch, "prompt_len": PROMPT_LEN}
                one = worker.run({**cmd, "output_len": 1})["seconds"]
                many = worker.run({**cmd, "output_len": steps + 1})["seconds"]
                per_step.append((many - one) / steps * 1e3)
            out[str(batch)] = round(statistics.median(per_step), 3)
    finally:
        worker.close()
    return out


def attention_layer_us(batch: int, calls: int = 400) -> dict[str, float]:
    """Mean µs of one layer's decode attention call of ``batch`` sequences (qwen2.5-0.5b's
    heads: 14 query, 2 KV, head dim 64; 200-token contexts; bf16; block 32): ``alone``
    derives the step's geometry itself (every layer before #39, and the first layer now);
    ``shared`` takes it from the step's ``step_cache`` (every later layer now). The kernel's
    own work is the same in both; the difference is host time saved per layer."""
    import torch

    from epdserve.kernels.backends import get_backend

    backend, bs, ctx = get_backend(None, "cpu"), 32, 200
    per_seq = -(-ctx // bs)
    kc = torch.randn(batch * per_seq + 1, bs, 2, 64, dtype=torch.bfloat16)
    args = (
        torch.randn(batch, 14, 64, dtype=torch.bfloat16),
        kc,
        torch.randn_like(kc),
        torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq),
        torch.full((batch,), ctx, dtype=torch.int32),
        torch.arange(batch + 1, dtype=torch.int32),
        0.125,
    )
    out = {}
    for name in ("alone", "shared", "alone", "shared"):  # the second pass is kept
        cache: dict = {}
        backend.paged_attention(*args, step_cache=cache)  # the first layer fills it
        t = time.perf_counter()
        for _ in range(calls):
            backend.paged_attention(*args, step_cache=cache if name == "shared" else None)
        out[name] = round((time.perf_counter() - t) / calls * 1e6, 1)
    out["saved_per_layer"] = round(out["alone"] - out["shared"], 1)
    return out


def main() -> None:
    import sys

    from vs_vllm_env import DEFAULT_VENV, cpu_info, ensure_vllm, venv_python

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", help="of the phases' engine")
    ap.add_argument("--phases-only", action="store_true", help="ours by phase, nothing else")
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get(
        "EPDSERVE_VLLM_VENV", DEFAULT_VENV)))  # fmt: skip
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = one_layer_checkpoint(Path(tmp) / "one-layer")
        result = {
            "bench": "step_host_time",
            "model": f"llama tiny, 1 layer, phases in {args.dtype}, step_ms in bf16",
            "cpu": cpu_info(),
            "batches": batches,
            "steps": args.steps,
            "phases_us": {
                str(b): median_phases(model, b, args.steps, args.dtype, args.rounds)
                for b in batches
            },
        }
        if args.phases_only:
            print(json.dumps(result, indent=2))
            return
        result["attention_layer_us"] = {str(b): attention_layer_us(b) for b in batches}
        ours = step_ms(sys.executable, "epdserve", model, batches, args.steps, args.rounds)
        result["step_ms"] = {"epdserve": ours}
        if not args.no_vllm:
            version, _ = ensure_vllm(args.vllm_venv, install=False)
            if version:
                python = str(venv_python(args.vllm_venv))
                theirs = step_ms(python, "vllm", model, batches, args.steps, args.rounds)
                result["step_ms"]["vllm"] = theirs
                result["ratio_vllm_over_ours"] = {
                    b: round(theirs[b] / ours[b], 2) for b in ours if ours[b] > 0
                }
            else:
                result["vllm"] = "not installed (bench/vs_vllm.py --install-vllm)"
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
