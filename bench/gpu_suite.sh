#!/usr/bin/env bash
# Everything tandem measures on a GPU, in one go (one device call): the GPU tests, then the
# benchmarks. Figures go to $OUT/figures.jsonl (one JSON line each), logs beside them.
#   bash bench/gpu_suite.sh            (OUT defaults to ./gpu-out)
# On a machine without pydantic or Ray it installs the offline bundle in .gpu/ first
# (scripts/offline_bundle.sh, docs/gpu.md).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ! python3 -c "import pydantic, ray" 2>/dev/null; then
  [ -d .gpu/site ] || bash .gpu/unpack.sh || { echo "no .gpu/: run scripts/offline_bundle.sh"; exit 2; }
  export PYTHONPATH=$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH} RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 BENCH_JSONL=$OUT/figures.jsonl
export TANDEM_BENCH_DIR=${TANDEM_BENCH_DIR:-/tmp/tandem-bench}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - start))s"
}
stage pytest 200 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rfE --timeout 100
tail -n 25 "$OUT/pytest.log"
stage train 140 python3 bench/train_throughput.py --profile "$OUT/profile.txt"
stage offload 100 python3 bench/offload.py
stage refit 200 python3 bench/refit_gpu.py
stage breakdown 150 sh -c "python3 bench/refit_breakdown.py --model 8b --bucket-mib 2048 &&
  python3 bench/refit_breakdown.py --model 1.5b --bucket-mib 512"
stage scan 60 sh -c "python3 bench/coalesce_scan.py --model 1.5b && python3 bench/coalesce_scan.py --model 8b &&
  python3 bench/store_latency.py"
stage timeline 90 sh -c "python3 bench/refit_timeline.py --model 1.5b --bucket-mib 1024 &&
  python3 bench/refit_timeline.py --model 8b --bucket-mib 2048"
stage megatron 240 python3 bench/megatron_parity.py
stage vision 120 python3 bench/vision_windows.py --images 16 --rounds 3
stage vlm_train 240 python3 bench/vlm_train_profile.py --profile "$OUT/vlm_profile"
for f in train offload refit breakdown scan timeline megatron vision vlm_train; do grep -E "Error|error:" "$OUT/$f.log" | tail -n 3; done
python3 - "$OUT/figures.jsonl" <<'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except FileNotFoundError:
    rows = []
for r in rows:
    keys = {k: v for k, v in r.items() if k not in ("figure", "value", "ratio", "mfu")}
    print(f"{r['figure']:<32} {r.get('value', '')!s:>10} {r.get('ratio', r.get('mfu', ''))!s:>6} {keys}")
PY
