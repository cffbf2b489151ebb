#!/usr/bin/env bash
# The GPU check (issue #16), one script, at most ~8 minutes, for a machine with a CUDA GPU:
#   1. the engine token-exact on the GPU: the Triton backend against the torch backend (fp32);
#   2. decode attention's HBM bandwidth with the Triton backend, as a share of the device's
#      peak (goal >= 0.6), and the offline engine's throughput with the Triton backend;
#   3. the LoRA Triton kernel against its torch twin, fp32 and bf16 (issue #29, ~1 minute).
# Everything is printed; JSON results also go to $OUT (or ./gpu-check-out).
#   PY=python3 bench/gpu_check.sh        # a Python with CUDA torch, triton and the project
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}
status=0

nvidia-smi -L || true
"$PY" - <<'PY' || { echo "no usable CUDA torch + triton: stopping"; exit 2; }
import torch, triton
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "device", torch.cuda.get_device_name())
PY
# the project importable without installing it: a src-layout shim over the checkout
if ! "$PY" -c "import epdserve.engine" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || status=1
fi

echo "== 1. token-exact: triton vs torch backend on cuda (fp32)"
EPDSERVE_TEST_DEVICE=cuda timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
  -k "not serve_" tests/engine/test_attention_backends.py 2>&1 | tee "$OUT/token_exact.txt" || status=1

echo "== 2. decode bandwidth and offline throughput (triton backend)"
timeout 240 "$PY" bench/gpu_decode.py ${QUICK:+--quick} | tee "$OUT/gpu_decode.json" || status=1

echo "== 3. LoRA: the Triton kernel against its torch twin on cuda (issue #29)"
timeout 90 "$PY" bench/lora_kernels.py --gpu | tee "$OUT/lora_triton.json" || status=1
exit $status
