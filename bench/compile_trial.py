"""``torch.compile`` of the decoder on the CPU against our eager path (issue #39 part 6; JSON).

The compiled path is vLLM's CPU one: the whole forward traced once by dynamo (dynamic token
count), compiled by inductor with weight freezing; attention is an opaque custom op reading
the step's metadata from a context (vLLM's forward context). Inductor owns the rest: RMSNorm
and residual adds as fused C++ loops, the matrix products as oneDNN ``_linear_pointwise`` on
weights it prepacks (residual adds fused as post-ops), SiLU*mul fused. Eager is the engine as
it ships: native C norms, rotary, cache write and attention, prepacked oneDNN products
(``kernels/linear.py``). Llama/Qwen2 layers only; LoRA or image steps would run eager.

Per model, a child process holds an eager and a compiled ``EngineCore`` (bf16, block 32,
2,048 batched tokens, no prefix caching, a fresh inductor cache) and alternates them over
``--rounds`` (order flipped each round). Per case, each round's median ``step_ms`` (a whole
``EngineCore.step``) and ``forward_ms`` (``model.forward``); min and median over rounds.
``first_call_ms``: the warm-up's slowest step per case (compiles included), then again in a
second process on the same inductor cache (``..._warm_cache``: a restart); ``graphs``: dynamo
graphs compiled by the case; ``tokens``: greedy outputs compared per request;
``fp32_tokens``: the same in float32, largest batch (the same computation but rounding).

    .venv/bin/python bench/compile_trial.py [--models tiny,qwen2.5-0.5b] [--rounds 5]
        [--mode default|max-autotune-no-cudagraphs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# per model: decode batch sizes, their prompt length and timed steps, prefill prompt lengths
CASES = {
    "tiny": {"decode": [1, 64, 256], "prompt": 8, "steps": 32, "prefill": []},
    "qwen2.5-0.5b": {"decode": [1, 32], "prompt": 16, "steps": 16, "prefill": [512]},
}
_CTX: dict = {}  # the step being run: model, metadata, KV caches (vLLM's forward context)


def register_attention_op() -> None:
    import torch

    from epdserve.engine.models.decoder import self_attention

    schema = "(Tensor qkv, int layer) -> Tensor"

    @torch.library.custom_op("epd_compile_trial::attention", mutates_args=(), schema=schema)
    def attention(qkv, layer):
        """One layer's rotary, cache write and paged attention, as eager runs them."""
        model, meta = _CTX["model"], _CTX["meta"]
        lay, (k_cache, v_cache), cfg = model.layers[layer], _CTX["caches"][layer], model.config
        out, _ = self_attention(model.kernels, cfg, qkv, meta, k_cache, v_cache, None,
                                lay.rope, model.scale, lay.window, cfg.attn_logit_softcap)  # fmt: skip
        return out.reshape(qkv.shape[0], cfg.q_size)

    @attention.register_fake
    def _(qkv, layer):
        return qkv.new_empty(qkv.shape[0], _CTX["model"].config.q_size)


def compiled_body(model):
    """The forward as an ``nn.Module`` owning the (plain) weights, so that freezing packs them."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    cfg = model.config
    assert not (cfg.qk_norm or model.layers[0].post_attn_norm is not None), "llama/qwen2 only"

    def rms(x, w, eps):  # kernels/norm_ref.py's formula
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def param(t):
        return None if t is None else nn.Parameter(t, requires_grad=False)

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = param(model.embed)
            self.layers = nn.ModuleList()
            for layer in model.layers:
                m = nn.Module()
                for name in ("in_norm", "qkv_w", "qkv_b", "o_w", "mlp_norm", "gate_up_w", "down_w"):
                    setattr(m, name, param(getattr(layer, name)))
                self.layers.append(m)

        def forward(self, ids):
            eps, inter = cfg.rms_norm_eps, cfg.intermediate_size
            residual = F.embedding(ids, self.embed)
            h = None
            for i, m in enumerate(self.layers):
                residual = residual if h is None else h + residual
                qkv = F.linear(rms(residual, m.in_norm, eps), m.qkv_w, m.qkv_b)
                residual = F.linear(torch.ops.epd_compile_trial.attention(qkv, i), m.o_w) + residual
                gate_up = F.linear(rms(residual, m.mlp_norm, eps), m.gate_up_w)
                h = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], m.down_w)
            return h + residual

    return Body()


def install_compiled(model, mode: str) -> None:
    """Replace ``model.forward`` by the compiled one for plain steps (others run eager)."""
    import torch
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    _CTX["model"] = model
    compiled = torch.compile(compiled_body(model), dynamic=True, mode=mode)
    eager = model.forward

    def forward(input_ids, meta, kv_caches, inputs_embeds=None):
        plain = inputs_embeds is None and not isinstance(meta, list)
        if not plain or meta.lora or meta.bidirectional_spans:
            return eager(input_ids, meta, kv_caches, inputs_embeds)
        _CTX["meta"], _CTX["caches"] = meta, kv_caches
        torch._dynamo.mark_dynamic(input_ids, 0)
        with torch.inference_mode():
            return compiled(input_ids)

    model.forward = forward


def make_core(path: str, dtype: str, compiled: str | None):
    """An in-process engine core; ``compiled``: the inductor mode (weights left unpacked for
    inductor to pack; the LM head, outside the graph, packed as eager packs it)."""
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core.engine_core import EngineCore
    from epdserve.kernels.linear import pack

    os.environ["EPDSERVE_PACKED_LINEAR"] = "0" if compiled else "1"
    config = EngineConfig(model=path, dtype=dtype, max_model_len=1024, kv_cache_memory=1 << 30,
                          block_size=32, max_num_batched_tokens=2048, max_num_seqs=256,
                          enable_prefix_caching=False)  # fmt: skip
    core = EngineCore(config)
    os.environ["EPDSERVE_PACKED_LINEAR"] = "1"
    model = core.executor.worker.runner.model
    if compiled:
        install_compiled(model, compiled)
        if model.lm_head is not model.embed:
            model.lm_head = pack(model.lm_head)
    core.forward_s = []
    inner = model.forward

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            core.forward_s.append(time.perf_counter() - t)

    model.forward = timed
    return core


def run_case(core, batch: int, prompt: int, steps: int, seed: int) -> dict:
    """``batch`` random prompts of ``prompt`` tokens to ``steps + 1`` greedy tokens: the
    prefill step(s), then the median decode step (whole step and forward)."""
    from epdserve.engine.core.engine_core import EngineCoreRequest
    from epdserve.engine.sampling_params import SamplingParams

    rng, tag = random.Random(seed), f"s{seed}-{time.monotonic_ns()}-"
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    reqs, vocab = [], core.executor.worker.runner.model.config.vocab_size
    for i in range(batch):
        ids = [rng.randrange(10, vocab) for _ in range(prompt)]
        core.add_request(EngineCoreRequest(f"{tag}{i}", ids, params))
        reqs.append(core.scheduler.requests[f"{tag}{i}"])
    prefill, decode, fwd_prefill, fwd_decode = [], [], [], []
    while core.scheduler.has_unfinished_requests():
        first = any(r.num_output_tokens == 0 for r in reqs)
        core.forward_s.clear()
        t = time.perf_counter()
        core.step()
        (prefill if first else decode).append(time.perf_counter() - t)
        (fwd_prefill if first else fwd_decode).extend(core.forward_s)
    step, fwd = (decode, fwd_decode) if decode else ([sum(prefill)], [sum(fwd_prefill)])
    return {"step_ms": statistics.median(step) * 1e3, "forward_ms": statistics.median(fwd) * 1e3,
            "slowest_ms": max(prefill + decode) * 1e3,
            "tokens": [list(r.output_token_ids) for r in reqs]}  # fmt: skip


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests whose greedy outputs are equal, and where the others first differ."""
    diverge = [
        next(i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y)
        for p, q in zip(a, b, strict=True)
        if p != q
    ]
    return {"requests_equal": f"{len(a) - len(diverge)}/{len(a)}", "first_divergence": diverge[:8]}


def stats(values: list[float]) -> dict:
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3)}


def child(name: str, path: str, rounds: int, mode: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    register_attention_op()
    spec = CASES[name]
    cases = [(f"decode b={b}", b, spec["prompt"], spec["steps"]) for b in spec["decode"]]
    cases += [(f"prefill {n}", 1, n, 0) for n in spec["prefill"]]
    cores = {k: make_core(path, "bfloat16", mode if k == "compiled" else None)
             for k in ("eager", "compiled")}  # fmt: skip
    out: dict = {"threads": torch.get_num_threads(), "first_call_ms": {}, "graphs": {}}
    out["tokens"] = {}
    for case, b, p, s in cases:  # warm-up: first calls (compiles), graphs, tokens
        graphs = counters["stats"]["unique_graphs"]
        runs = {k: run_case(core, b, p, s, seed=b * 7919 + p) for k, core in cores.items()}
        out["first_call_ms"][case] = {k: round(r["slowest_ms"], 1) for k, r in runs.items()}
        out["graphs"][case] = counters["stats"]["unique_graphs"] - graphs
        out["tokens"][case] = compare(runs["eager"]["tokens"], runs["compiled"]["tokens"])
    timed: dict = {c[0]: {k: {"step_ms": [], "forward_ms": []} for k in cores} for c in cases}
    for r in range(rounds):
        order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
        for case, b, p, s in cases:
            for k in order:
                res = run_case(cores[k], b, p, s, seed=1000 * (r + 1) + b + p)
                for m in ("step_ms", "forward_ms"):
                    timed[case][k][m].append(res[m])
    out["cases"] = {}
    for case, per in timed.items() if rounds else ():
        row = {k: {m: stats(v) for m, v in d.items()} for k, d in per.items()}
        e, c = row["eager"]["step_ms"]["median"], row["compiled"]["step_ms"]["median"]
        row["compiled_over_eager"] = round(c / e, 3)
        out["cases"][case] = row
    for core in cores.values():
        core.close()
    if rounds:  # rounding apart, the same computation: float32 tokens must agree
        fp = [make_core(path, "float32", m) for m in (None, mode)]
        b = min(spec["decode"][-1], 64)
        runs = [run_case(core, b, spec["prompt"], 8, seed=5)["tokens"] for core in fp]
        out["fp32_tokens"] = compare(*runs)
        for core in fp:
            core.close()
    return out


def checkpoint(name: str, out: Path) -> Path:
    if name == "tiny":
        from step_host_time import one_layer_checkpoint

        return one_layer_checkpoint(out / "tiny")
    from epdserve.engine.make_model import make_model

    return make_model("qwen2", out / name, seed=0, preset=name)  # bf16, Qwen2 (q/k/v biases)


def run_child(name: str, path: Path, rounds: int, mode: str, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", name, str(path)]
    cmd += ["--rounds", str(rounds), "--mode", mode]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,qwen2.5-0.5b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", default="default", choices=["default", "max-autotune-no-cudagraphs"])
    ap.add_argument("--child", nargs=2, metavar=("NAME", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.rounds, args.mode)))
        return
    import torch
    from vs_vllm_env import cpu_info

    result = {"bench": "compile_trial", "cpu": cpu_info(), "torch": torch.__version__,
              "mode": args.mode, "rounds": args.rounds}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = checkpoint(name, Path(tmp))
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor-{name}"}
            t = time.perf_counter()
            result[name] = run_child(name, path, args.rounds, args.mode, env)
            result[name]["process_s"] = round(time.perf_counter() - t, 1)
            # a second process on the same inductor cache: what a restart pays to compile
            warm = run_child(name, path, 0, args.mode, env)["first_call_ms"]
            result[name]["first_call_ms_warm_cache"] = warm
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
