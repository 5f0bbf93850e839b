#!/usr/bin/env bash
# A batch of cells of the real-scale matrix on one GPU: random Qwen2.5 shapes with the
# 151,936-token vocabulary, 32 prompts x 8 samples, response lengths spread up to the cap,
# fp32 masters + bf16 compute with activation checkpointing, tandem and TRL alternating.
# JSON lines go to $OUT/real_scale.jsonl (each cell's log beside it); a cell that runs past
# its time limit or fails leaves a {"figure": "cell", "rc": ...} line saying so.
#
#   bash bench/real_scale_gpu.sh SHAPE:MAX_TOKENS:SECONDS[:trl] ...
#   e.g. bash bench/real_scale_gpu.sh 0.5b:2048:360:trl 1.5b:2048:400:trl 7b:2048:500
# Environment: OUT (default /tmp/real-scale), STEPS (default 2), PYTHON (default python3),
# EXTRA (more e2e_gpu.py arguments, e.g. "--layers 1 --prompts 2" for a dry run on a CPU).
set -u
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/real-scale}
mkdir -p "$OUT"
export BENCH_JSONL="$OUT/real_scale.jsonl"
export PYTHONPATH="$here:${PYTHONPATH:-}"
for cell in "$@"; do
    IFS=: read -r shape max_tokens seconds trl <<<"$cell"
    mean=$((max_tokens / 4))  # geometric-like lengths: tens of tokens to the cap
    args=(--shapes "$shape" --real-vocab --mean-length "$mean" --max-tokens "$max_tokens"
          --steps "${STEPS:-2}" --prompts 32 --generations 8 --mixed-precision
          --activation-checkpointing --micro-batch-size 8 --max-tokens-per-micro-batch 16384)
    if [ "$trl" = "trl" ]; then args+=(--trl --rounds 1 --trl-micro-batch 8); fi
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=20 "$seconds" "${PYTHON:-python3}" "$here/e2e_gpu.py" \
        "${args[@]}" ${EXTRA:-} >"$OUT/cell-$shape-$max_tokens.log" 2>&1
    rc=$?
    printf '{"figure": "cell", "shape": "%s", "max_tokens": %s, "trl": "%s", "rc": %s, "limit_s": %s}\n' \
        "$shape" "$max_tokens" "$trl" "$rc" "$seconds" >>"$BENCH_JSONL"
done
