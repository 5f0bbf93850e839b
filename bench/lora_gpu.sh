#!/usr/bin/env bash
# LoRA on one GPU: each part fits one call of at most 10 minutes (each runs under its own time
# limit and leaves a {"figure": "lora_part", "rc": ...} line; rc 124 is the limit).
#
#   bash bench/lora_gpu.sh refit          (a) the 1.5B real shape, rank 32 on every linear
#       projection (bench/lora.py): LoRA refit time and bytes against the full-parameter refit
#       (goals <= 5 %, <= 2 %), train step, generation, offload/onload, device memory per phase;
#       modes full, lora (adapter refit), lora_keep_base (offload_base=false), lora_merged
#   bash bench/lora_gpu.sh 7b             (b) 7B LoRA GRPO colocated through the real runtime
#       (Ray actors, cluster.env_mode=shared, generation.backend=hf; bench/e2e_gpu.py), rank 32,
#       a few steps: the base offloaded with the adapters (policy.lora.offload_base=true: 0 B
#       on the device after the trainer's offload), then kept resident (false); every phase's
#       time, the trainer's bytes after offload / at refit, the device's peak in use
#   bash bench/lora_gpu.sh 7b-offload | 7b-resident     one of the two 7B runs (on a GPU: one
#       call each, since each may take most of its 500 s; the first writes the random 7B model
#       to /tmp/tandem-e2e, which a second call on the same warm machine reuses)
#   bash bench/lora_gpu.sh trl            (c) the 1.5B LoRA GRPO step, tandem and TRL's
#       GRPOTrainer (peft LoraConfig of the same rank and modules) alternating
#   bash bench/lora_gpu.sh trl-mp         (c) with policy.mixed_precision on tandem's side (fp32
#       adapters, bf16 compute, as TRL's --bf16 autocast computes them; without it peft casts
#       every adapted layer's input to fp32)
#   bash bench/lora_gpu.sh trl-resident   (c) as trl-mp, with cluster.memory_phases=false: trainer
#       and generator stay on the device together (no offload/onload, sleep/wake a step), as
#       TRL's trainer and its generation do
#   bash bench/lora_gpu.sh --tiny all     every part at a tiny shape (one layer of 0.5B), on a
#       CPU too: checks the script end to end
#
# Environment: OUT (default /tmp/lora-out): lora.jsonl (every JSON line) and a log per part;
# LIMIT: each real part's limit in seconds (default 500);
# PYTHON (default python3); TRL_PYTHON (the Python with TRL, default PYTHON). On an offline GPU
# machine the bundle (scripts/offline_bundle.sh: Ray, pydantic, peft, TRL...) is unpacked first
# when .gpu/site is missing; PYTHONPATH gets .gpu/site, src and bench.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
tiny=0
if [ "${1:-}" = "--tiny" ]; then tiny=1; shift; fi
[ $# -gt 0 ] || { sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
OUT=${OUT:-/tmp/lora-out}
PYTHON=${PYTHON:-python3}
TRL_PYTHON=${TRL_PYTHON:-$PYTHON}
mkdir -p "$OUT"
export BENCH_JSONL="$OUT/lora.jsonl"
if [ -f "$root/.gpu/unpack.sh" ] && [ ! -d "$root/.gpu/site" ] && command -v nvidia-smi >/dev/null; then
    bash "$root/.gpu/unpack.sh"  # the bundle's wheels are for the GPU machine's Python
fi
export PYTHONPATH="$root/.gpu/site:$root/src:$root/bench${PYTHONPATH:+:$PYTHONPATH}"
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0

# the shapes and sizes of each part: the real ones, or a one-layer 0.5B (--tiny)
if [ $tiny = 1 ]; then
    refit_args=(--tiny)
    big=(--shapes 0.5b --layers 1 --lora 4 --steps 2 --prompts 2 --generations 2
         --max-tokens 8 --micro-batch-size 4 --set cluster.runtime=ray)
    small=("${big[@]}" --trl-micro-batch 2)
    limit=(600 600 900)
else
    refit_args=(--shape 1.5b --rank 32 --batch 8 --seq 512 --steps 3)
    # one micro-batch a step on tandem's side (64 rows of <= 128 + prompt tokens, within the
    # 16,384-token budget): a LoRA train step costs host work per micro-batch (peft's layers;
    # 8.6 s for 8 micro-batches of 8 at 1.5B on an H100); TRL's at 32 rows (its full-vocabulary
    # logits: ~3.5 GB in fp32 for 32 rows of ~180 tokens); 4 steps a side and round: the
    # medians of steps 2-4 (step 2 still carries one-time work, e.g. the generator's first
    # offload after its LoRA layers appear)
    big=(--shapes 7b --lora 32 --steps 3 --prompts 8 --generations 8 --mean-length 32
         --max-tokens 128 --micro-batch-size 64 --activation-checkpointing)
    small=(--shapes 1.5b --lora 32 --steps 4 --prompts 8 --generations 8 --mean-length 32
           --max-tokens 128 --micro-batch-size 64 --activation-checkpointing --trl-micro-batch 32)
    limit=("${LIMIT:-500}" "${LIMIT:-500}" "${LIMIT:-500}")  # room for the bundle's unpack in a 10-minute call
fi

part() {  # name, limit in seconds, command...
    local name=$1 seconds=$2
    shift 2
    echo "== $name (limit ${seconds}s): $*" >&2
    timeout --signal=INT --kill-after=20 "$seconds" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep '^{' "$OUT/$name.log" || true
    printf '{"figure": "lora_part", "part": "%s", "tiny": %s, "rc": %s, "limit_s": %s}\n' \
        "$name" "$tiny" "$rc" "$seconds" | tee -a "$BENCH_JSONL"
}

e2e=("$PYTHON" "$root/bench/e2e_gpu.py" --real-vocab)

for what in "$@"; do
    case $what in
        refit) part refit "${limit[0]}" "$PYTHON" "$root/bench/lora.py" "${refit_args[@]}" ;;
        7b-offload) part 7b-offload "${limit[1]}" "${e2e[@]}" "${big[@]}" --set policy.lora.offload_base=true ;;
        7b-resident) part 7b-resident "${limit[1]}" "${e2e[@]}" "${big[@]}" --set policy.lora.offload_base=false ;;
        7b) "$0" $([ $tiny = 1 ] && echo --tiny) 7b-offload 7b-resident ;;
        trl) part trl "${limit[2]}" "${e2e[@]}" "${small[@]}" --trl --rounds 2 --trl-python "$TRL_PYTHON" ;;
        trl-mp) part trl-mp "${limit[2]}" "${e2e[@]}" "${small[@]}" --mixed-precision --trl --rounds 2 \
                    --trl-python "$TRL_PYTHON" ;;
        trl-resident) part trl-resident "${limit[2]}" "${e2e[@]}" "${small[@]}" --mixed-precision --trl \
                    --rounds 2 --trl-python "$TRL_PYTHON" --set cluster.memory_phases=false ;;
        all) "$0" $([ $tiny = 1 ] && echo --tiny) refit 7b trl ;;
        *) echo "lora_gpu.sh: unknown part '$what' (refit, 7b, 7b-offload, 7b-resident, trl, trl-mp, trl-resident, all)" >&2
           exit 2 ;;
    esac
done
