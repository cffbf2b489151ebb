"""Attention backends: the registry, and the whole engine on the Triton kernels (interpreted
on CPU, fp32) token-exact against the torch backend under every scheduling regime."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdserve.engine.config import EngineConfig
from epdserve.kernels import native
from epdserve.kernels.backends import (
    BACKEND_NAMES,
    KernelBackend,
    check_backend,
    default_backend,
    get_backend,
)

RUNS = Path(__file__).with_name("attention_backend_runs.py")
LONGEST_CONTEXT = 47 + 8  # the runner's longest prompt plus its output tokens


def test_every_backend_name_builds_its_backend():
    for name in ("torch", "native") if native.available() else ("torch",):
        backend = get_backend(name, "cpu")
        assert isinstance(backend, KernelBackend) and backend.name == name
    assert set(BACKEND_NAMES) == {"triton", "native", "torch"}


def test_default_backend_follows_the_device():
    assert default_backend("cuda") == "triton"
    assert default_backend(torch.device("cuda:1")) == "triton"
    assert default_backend("cpu") == ("native" if native.available() else "torch")
    assert get_backend(None, "cpu").name == default_backend("cpu")


def test_unknown_backend_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="attention_backend: must be one of triton, native"):
        get_backend("flash", "cpu")


def test_native_backend_is_refused_off_cpu():
    with pytest.raises(ValueError, match="attention_backend: native runs on CPU only"):
        check_backend("native", "cuda")


def test_triton_on_cpu_without_the_interpreter_is_refused_at_config(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend: triton on cpu tensors needs"):
        EngineConfig(model="unused", device="cpu", attention_backend="triton")


def test_triton_without_triton_installed_is_refused(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "triton" else real(n, *a)
    )
    with pytest.raises(ValueError, match="attention_backend: triton is not installed"):
        check_backend("triton", "cuda")


def serve_refusal(model, *args) -> str:
    """The message ``epdserve serve`` exits with, before any model loads."""
    import argparse

    from epdserve.engine.entrypoints import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        serve_cli.run(parser.parse_args([str(model), "--device", "cpu", *args]))
    return str(exc.value)


def test_serve_refuses_triton_on_cpu_without_the_interpreter(models, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "attention_backend: triton on cpu" in serve_refusal(
        models.get("llama"), "--attention-backend", "triton"
    )


def test_serve_reads_the_backend_from_the_environment(models, monkeypatch):
    monkeypatch.setenv("EPDSERVE_ATTENTION_BACKEND", "flash")
    assert "attention_backend: must be one of" in serve_refusal(models.get("llama"))


def test_torch_and_native_backends_agree_on_a_mixed_batch():
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(6, 16, 2, 32, generator=g)
    vc = torch.randn(6, 16, 2, 32, generator=g)
    q = torch.randn(1 + 5 + 1, 4, 32, generator=g)  # decode, prefill of 5, decode
    table = torch.tensor([[1, 2], [3, 0], [4, 5]], dtype=torch.int32)
    lens = torch.tensor([20, 5, 17], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 6, 7], dtype=torch.int32)
    args = (q, kc, vc, table, lens, qsl, 0.2)
    ref = get_backend("torch").paged_attention(*args, sliding_window=8)
    out = get_backend(default_backend("cpu")).paged_attention(*args, sliding_window=8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def greedy_runs(path, backend: str, full: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the runner sets it for triton only
    cmd = [sys.executable, str(RUNS), str(path), backend] + (["--full"] if full else [])
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def assert_token_exact(models, arch: str, full: bool) -> None:
    pytest.importorskip("triton")
    path = models.get(arch)
    want = greedy_runs(path, "torch", full)
    got = greedy_runs(path, "triton", full)
    for regime, ref in want.items():
        assert got[regime]["tokens"] == ref["tokens"], f"{arch}: triton differs in {regime}"
        for seq, (a, b) in enumerate(zip(got[regime]["logprobs"], ref["logprobs"], strict=True)):
            assert a == pytest.approx(b, abs=1e-4), f"{arch} {regime}: logprobs of seq {seq}"
        assert got[regime]["free_ok"] and ref["free_ok"], f"{arch}: KV blocks leaked in {regime}"
    assert got["preemption"]["preemptions"] > 0
    cached = got["prefix-hits"]["cached"]
    assert cached[len(cached) // 2] > 0  # the long first prompt's second pass hit the cache


# Slow: under the interpreter llama takes 22-41 s, gemma3 ~3.5 min (norm and rotary run as
# Triton too); every Triton kernel, sliding windows included, is checked against its torch
# twin in tests/kernels in the fast tier
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_triton_backend_is_token_exact_with_torch_in_every_regime(models, arch):
    if arch == "gemma3":  # prompt + output pass the sliding window
        cfg = json.loads((models.get(arch) / "config.json").read_text())
        assert cfg["text_config"]["sliding_window"] < LONGEST_CONTEXT
    assert_token_exact(models, arch, full=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_triton_backend_is_token_exact_with_torch_on_more_prompts(models, arch):
    assert_token_exact(models, arch, full=True)
