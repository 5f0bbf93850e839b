#!/usr/bin/env bash
# One cell of the real-scale matrix per call (each fits a 10-minute call): a random Qwen2.5
# shape with the 151,936-token vocabulary, 32 prompts x 8 samples of up to 2048 tokens with
# lengths spread by an EOS bias (mean asked: 512), fp32 masters + bf16 compute, activation
# checkpointing; tandem (generation.backend=hf, cluster.env_mode=shared) and then TRL's
# GRPOTrainer on the same work, each in its own process under the time left
# (bench/real_scale.py). JSON lines on stdout and in $OUT/real_scale.jsonl (each part's log
# beside it); a part that fails or runs out of time leaves a real_scale_error /
# real_scale_unfinished line and the cell goes on; real_scale_cell ends the cell.
#
#   bash bench/real_scale_gpu.sh CELL [bench/real_scale.py options]
#   CELL: 0.5b | 1.5b | 3b | 7b, or tiny (a CPU check of the whole path: the 0.5B width with one
#         layer, 2 prompts x 2 samples of up to 32 tokens)
#   e.g.  bash bench/real_scale_gpu.sh 0.5b                  # tandem, then TRL with the rest
#         bash bench/real_scale_gpu.sh 0.5b --sides decode   # the generator alone, now / before
#         bash bench/real_scale_gpu.sh 1.5b --sides tandem   # TRL in the next call:
#         bash bench/real_scale_gpu.sh 1.5b --sides trl
#         bash bench/real_scale_gpu.sh 1.5b --prompts 16     # less work where time runs short
# Environment: OUT (default /tmp/real-scale), PYTHON (default python3), TRL_PYTHON (a Python
# with TRL; default PYTHON). On the GPU machine, first:
#   bash .gpu/unpack.sh && export PYTHONPATH=$PWD/.gpu/site:$PWD/src
set -u
here=$(cd "$(dirname "$0")" && pwd)
cell=${1:-}
shift || true
case "$cell" in
    0.5b | 1.5b | 3b | 7b) args=(--shape "$cell") ;;
    tiny) args=(--shape 0.5b --layers 1 --prompts 2 --generations 2 --max-tokens 32
                --micro-batch-size 4 --max-tokens-per-micro-batch 512 --trl-micro-batch 2
                --budget-s 1500 --trl-reserve-s 300) ;;
    *)
        printf '{"figure": "real_scale_error", "part": "cell", "why": "unknown cell %s: give 0.5b, 1.5b, 3b, 7b or tiny"}\n' "$cell"
        exit 2 ;;
esac
export PYTHONPATH="$here:$here/../src:${PYTHONPATH:-}"
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
python=${PYTHON:-python3}
exec "$python" "$here/real_scale.py" "${args[@]}" --python "$python" \
    --trl-python "${TRL_PYTHON:-$python}" --out "${OUT:-/tmp/real-scale}" "$@"
