#!/usr/bin/env bash
# Cross-runtime validation on a CUDA machine: the tiny K3 (or MODEL_DIR) exported to ONNX, validated with the
# PyTorch reference and the Triton kernels on CUDA (compiled, not interpreted: full decode length), ONNX
# Runtime (CUDA EP when onnxruntime-gpu is installed, else CPU), TensorRT when an engine is given; then the
# kernel timings of bench/kernel_timings.py.
#
#   examples/validate_gpu.sh [OUT_DIR] [MODEL_DIR] [ENGINE]
# Exit status: non-zero when any runtime disagrees with the reference (fail closed).
set -euo pipefail

OUT=${1:-k3export-gpu-validation}
MODEL_DIR=${2:-}
ENGINE=${3:-}
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
unset TRITON_INTERPRET  # compiled kernels on the GPU

python - <<'PY' || { echo "no CUDA device: use 'k3export quickstart' on CPU" >&2; exit 3; }
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
PY

if [[ -z "$MODEL_DIR" ]]; then
  MODEL_DIR="$OUT/model"
  python - "$MODEL_DIR" <<'PY'
import sys
from k3export.modeling import save_pretrained, tiny_model
save_pretrained(tiny_model(0), sys.argv[1])
PY
fi

python - "$MODEL_DIR" "$OUT/onnx" <<'PY'
import sys
from k3export.converters.onnx import export_onnx
export_onnx(sys.argv[1], sys.argv[2], dtype="fp32", overwrite=True)
PY

RUNTIMES="torch,triton,ort"
if python -c "import onnxruntime as o, sys; sys.exit(0 if 'CUDAExecutionProvider' in o.get_available_providers() else 1)"; then
  RUNTIMES="$RUNTIMES,ort-cuda"
fi
EXTRA=()
if [[ -n "$ENGINE" ]]; then
  RUNTIMES="$RUNTIMES,trt"
  EXTRA+=(--engine "$ENGINE")
fi

status=0
k3export validate "$MODEL_DIR" --onnx "$OUT/onnx" --runtimes "$RUNTIMES" "${EXTRA[@]}" \
  --device cuda --prompt-len 64 --steps 64 --batch 4 \
  --report "$OUT/report.json" --plot "$OUT/plot.png" || status=$?

echo "--- kernel timings (bench/kernel_timings.py) ---"
python "$HERE/bench/kernel_timings.py" || echo "bench/kernel_timings.py failed (status $?)" >&2
exit $status
