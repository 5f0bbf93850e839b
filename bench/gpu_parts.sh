#!/usr/bin/env bash
# The GPU measurements of open goals, in parts that fit one device call of at most 10 minutes
# each (bench/gpu_suite.sh runs everything in one go and takes longer). Run from the checkout's
# root on the GPU machine; the offline bundle in .gpu/ (scripts/offline_bundle.sh, docs/gpu.md)
# is unpacked when .gpu/site is missing. Each command of a part runs under its own time limit;
# its whole log goes to $OUT/<part>-<n>.log (default OUT=/tmp/gpu-parts), and only its JSON
# lines, pytest's summary and errors are printed, so a call's output stays short.
#
#   bash bench/gpu_parts.sh PART [PART ...]
#   offload      storage offload, Megatron and CUDA IPC refit GPU tests; the Megatron trainer's
#                offload/onload against the pinned-copy ceiling (megatron_parity --only offload),
#                host-to-device copies by host memory kind and onload shape (pinned_rate) ~330 s
#   lora-refit   1.5B rank-32 adapter refit against the full refit, in the loop, back to back and
#                after an onload (bench/lora.py)                                             ~150 s
#   lora-phases  LoRA generate/train phases against the full model's, then LoRA with
#                policy.mixed_precision (bench/lora_phases.py)                               ~250 s
#   lora-trl     tandem's LoRA GRPO step against TRL's, bf16 compute, trainer and generator kept
#                resident (bench/lora_gpu.sh trl-resident)                                 ~560 s
#   tests        every GPU test                                                              ~300 s
#   decode       the transformers generator's GPU tests, then its decode at 0.5B x 2048 tokens
#                (vocabulary 151,936) now and with the attention it had before its windows
#                (bench/real_scale_gpu.sh 0.5b --sides decode)                               ~350 s
#   decode-7b-4096  the transformers generator's GPU tests, then its decode alone at 7B x 4096
#                tokens: all rows in one decode (the cache grows with them), the rows in two
#                halves (as before it grew), and one decode with new weights landing halfway
#                (its rows prefilled again in bounded calls); each with its peak memory     ~480 s
#   decode-7b-compile  the decode alone at 7B x 4096 tokens with compiled decoder layers
#                (generation.compile) against eager ones, both captured in CUDA graphs      ~420 s
#   decode-compile  the transformers generator's GPU tests (compiled layers among them); a
#                sampling step's parts at 112 and 256 rows (bench/sampling_step.py); its
#                decode at 0.5B x 2048 tokens with compiled decoder layers against without
#                (generation.compile; forward ms a step); then the 1.5B x 2048 cell's tandem
#                side with generation.compile=true                                          ~560 s
#   train-mfu    the train phase at 1.5B, 32 x 2048 tokens, micro-batches of 8 / 16,384 tokens,
#                with and without activation checkpointing, compiled layers and not; then the
#                profile of a compiled step without checkpointing (bench/train_phase_profile.py,
#                $OUT/fsdp_mp_compile.txt)                                                   ~450 s
#   train-spread what a micro-batch shape never seen before costs each attention kernel
#                (bench/sdpa_shapes.py); the train phase at 1.5B with new random lengths every
#                step, as in the loop, cuDNN attention first (the default) and flash first; the
#                loss's extra memory at 16,384 tokens (bench/chunked_loss_memory.py)         ~300 s
#   train-pack   the train phase at 1.5B with new random lengths every step (as train-spread):
#                padded micro-batches, packed ones (policy.packing), compiled layers      ~250 s
#   trained-floor  a 1.5B-shape model trained for 210 s on the standard library's sources: its
#                bf16 full-sequence/decode logprob gap as it trains (bench/trained_floor.py) ~330 s
#   trained-floor-7b  the same at the 7B shape, trained as the 80 GB recipe does (bf16 weights
#                and AdamW state, stochastic rounding, checkpointing: --bf16-state)           ~450 s
#   cell-0.5b    tandem's side of the real-scale cell 0.5B x 2048 (cell-0.5b-trl: TRL's, in its
#                own call: its first step alone took over 190 s on an H100)                  ~560 s
#   cell-1.5b    tandem's side of the 1.5B cell (cell-1.5b-trl: TRL's, in its own call)      ~560 s
#   cell-7b      tandem's side at 7B: bf16 parameters and AdamW state, to fit 80 GB, rounded
#                stochastically (policy.optimizer.bf16_stochastic_round: torchao)            ~310 s
#   cell-7b-fp32 tandem's side at 7B with fp32 master weights (122 GB of state: an H200)    ~560 s
#   cell-...-512, cell-...-4096  any cell above with at most 512 / 4096 new tokens (mean a
#                quarter of it) instead of 2048, TRL's micro-batch 32 / 4 instead of 8 (the
#                same tokens), e.g. cell-0.5b-4096, cell-0.5b-trl-512
#                SET="policy.compile=true policy.packing=true" adds those overrides to
#                tandem's side of any cell (policy.compile: the generator's layers compile too)
#   cell-tiny    the cells' path at a tiny shape (a check on a CPU: TRL_PYTHON, a Python with TRL)
#   brief        where device time is short, one figure of each open question: the onload shapes
#                of pinned_rate, the transformers generator's GPU tests, the 1.5B train phase
#                with checkpointing, compiled and not                                        ~380 s
set -u
cd "$(dirname "$0")/.."
usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -gt 0 ] || usage
for part in "$@"; do
    case $part in
        offload | lora-refit | lora-phases | lora-trl | tests | decode | train-mfu | brief) ;;
        decode-compile | decode-7b-4096 | decode-7b-compile) ;;
        train-spread | train-pack | trained-floor | trained-floor-7b) ;;
        cell-*)
            base=$part
            case $part in *-512 | *-4096) base=${part%-*} ;; esac
            case $base in
                cell-0.5b | cell-0.5b-trl | cell-1.5b | cell-1.5b-trl | cell-7b | cell-7b-fp32) ;;
                cell-tiny) ;;
                *) usage ;;
            esac ;;
        *) usage ;;
    esac
done
OUT=${OUT:-/tmp/gpu-parts}
mkdir -p "$OUT"
if command -v nvidia-smi >/dev/null && ! python3 -c "import pydantic, ray" 2>/dev/null; then
    [ -d .gpu/site ] || bash .gpu/unpack.sh >/dev/null || { echo "no .gpu/: run scripts/offline_bundle.sh"; exit 2; }
    export PYTHONPATH=$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
git log --oneline -1 2>/dev/null || true

run() {  # part, limit in seconds, command...
    local part=$1 limit=$2
    shift 2
    local n=1
    while [ -e "$OUT/$part-$n.log" ]; do n=$((n + 1)); done
    local log="$OUT/$part-$n.log" start=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    grep -E '^\{|^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped)|Error:' "$log" | cut -c1-2000
    echo "== $part-$n rc=$rc $((SECONDS - start))s: $*"
}

gpu_tests=(python3 -m pytest -q -p no:cacheprovider -rfE)
for part in "$@"; do
    case $part in
        offload)
            run offload 180 "${gpu_tests[@]}" tests/gpu/test_offload_gpu.py \
                tests/gpu/test_megatron_gpu.py tests/gpu/test_refit_gpu.py
            run offload 200 python3 bench/megatron_parity.py --only offload
            run offload 120 python3 bench/pinned_rate.py ;;
        lora-refit)
            run lora-refit 240 python3 bench/lora.py --shape 1.5b --rank 32 --batch 8 --seq 512 \
                --steps 3 --modes full lora ;;
        lora-phases)
            run lora-phases 200 python3 bench/lora_phases.py --shape 1.5b
            run lora-phases 150 python3 bench/lora_phases.py --shape 1.5b --modes lora --mixed-precision ;;
        lora-trl)
            export LIMIT=${LIMIT:-520}  # lora_gpu.sh's own limit, inside this one
            run lora-trl 560 bash bench/lora_gpu.sh trl-resident ;;
        tests)
            run tests 560 "${gpu_tests[@]}" tests/gpu ;;
        decode)
            run decode 120 "${gpu_tests[@]}" tests/gpu/test_hf_generator_gpu.py
            run decode 270 env OUT="$OUT/real-scale" bash bench/real_scale_gpu.sh 0.5b \
                --sides decode --budget-s 250 ;;
        decode-7b-4096)
            run decode-7b-4096 120 "${gpu_tests[@]}" tests/gpu/test_hf_generator_gpu.py
            run decode-7b-4096 400 env OUT="$OUT/real-scale" bash bench/real_scale_gpu.sh 7b \
                --sides decode --max-tokens 4096 --budget-s 390 \
                --decode-paths tandem_cuda_graphs tandem_two_chunks tandem_refit_mid ;;
        decode-7b-compile)
            run decode-7b-compile 450 env OUT="$OUT/real-scale" bash bench/real_scale_gpu.sh 7b \
                --sides decode --max-tokens 4096 --budget-s 440 \
                --decode-paths tandem_cuda_graphs tandem_compiled ;;
        decode-compile)
            run decode-compile 120 "${gpu_tests[@]}" tests/gpu/test_hf_generator_gpu.py
            for rows in 112 256; do
                run decode-compile 40 python3 bench/sampling_step.py --rows "$rows"
            done
            run decode-compile 180 env OUT="$OUT/real-scale" bash bench/real_scale_gpu.sh 0.5b \
                --sides decode --budget-s 170 --decode-paths tandem_cuda_graphs tandem_compiled
            run decode-compile 200 env OUT="$OUT/real-scale" bash bench/real_scale_gpu.sh 1.5b \
                --sides tandem --budget-s 190 --set generation.compile=true ;;
        train-mfu)
            run train-mfu 330 python3 bench/train_phase_profile.py --shape 1.5b --sequences 32 \
                --length 2048 --steps 2 --settings fsdp_mp_ac_compile fsdp_mp_ac fsdp_mp_compile \
                fsdp_mp --micro-batch-size 8 --max-tokens-per-micro-batch 16384
            run train-mfu 120 python3 bench/train_phase_profile.py --shape 1.5b --sequences 32 \
                --length 2048 --steps 1 --settings fsdp_mp_compile --micro-batch-size 8 \
                --max-tokens-per-micro-batch 16384 --profile "$OUT" ;;
        train-spread)
            run train-spread 60 python3 bench/sdpa_shapes.py
            for sdpa in cudnn flash; do
                run train-spread 100 python3 bench/train_phase_profile.py --shape 1.5b --sequences 64 \
                    --length 2048 --steps 4 --spread --sdpa "$sdpa" --settings fsdp_mp_ac \
                    --micro-batch-size 64 --max-tokens-per-micro-batch 65536
            done
            run train-spread 60 python3 bench/chunked_loss_memory.py --tokens 16384 --hidden 1536 ;;
        trained-floor)
            run trained-floor 400 python3 bench/trained_floor.py --shape 1.5b --train-s 210 ;;
        trained-floor-7b)
            run trained-floor-7b 560 python3 bench/trained_floor.py --shape 7b --bf16-state \
                --batch 4 --lr 3e-4 --train-s 300 ;;
        train-pack)
            run train-pack 260 python3 bench/train_phase_profile.py --shape 1.5b --sequences 64 \
                --length 2048 --steps 4 --spread --settings fsdp_mp_ac fsdp_mp_ac_pack \
                fsdp_mp_ac_compile --micro-batch-size 64 --max-tokens-per-micro-batch 65536 ;;
        brief)
            run brief 90 python3 bench/pinned_rate.py
            run brief 120 "${gpu_tests[@]}" tests/gpu/test_hf_generator_gpu.py
            run brief 200 python3 bench/train_phase_profile.py --shape 1.5b --sequences 32 \
                --length 2048 --steps 2 --settings fsdp_mp_ac_compile fsdp_mp_ac \
                --micro-batch-size 8 --max-tokens-per-micro-batch 16384 ;;
        cell-*)
            cell=${part#cell-} tokens=()
            case $cell in
                *-512 | *-4096)  # TRL's micro-batch: the 16,384 tokens that fit at 2048
                    tokens=(--max-tokens "${cell##*-}" --trl-micro-batch $((16384 / ${cell##*-})))
                    cell=${cell%-*} ;;
            esac
            case $cell in
                0.5b | 1.5b) sides=(--sides tandem) ;;
                0.5b-trl | 1.5b-trl) cell=${cell%-trl} sides=(--sides trl) ;;
                # 7B: micro-batches of 16,384 tokens (65,536 would need ~30 GB of activations
                # beside 43 GB of parameters and AdamW state and 14 GB of gradients)
                7b) sides=(--sides tandem --micro-batch-size 16 --max-tokens-per-micro-batch 16384
                           --set policy.mixed_precision=false --set policy.dtype=bfloat16
                           --set policy.optimizer.bf16_stochastic_round=true) ;;
                # 7B fp32: its 122 GB of state cannot be page-locked on a 128 GB host; the
                # offload moves AdamW's 61 GB, the weights stay (policy.offload_weights)
                7b-fp32) cell=7b sides=(--sides tandem --micro-batch-size 16
                                        --max-tokens-per-micro-batch 16384
                                        --set policy.offload_weights=false) ;;
                *) sides=() ;;
            esac
            for item in ${SET:-}; do sides+=(--set "$item"); done
            # compiled layers build a graph for each form of call when it first comes (a
            # micro-batch of one row is one): steps 3 and 4 show the compiled step as it stays
            case " ${SET:-}" in *compile=true*) sides+=(--steps 4) ;; esac
            if [ "$cell" != tiny ] && [ "${sides[1]:-}" != trl ]; then  # the sleep it runs on
                run "$part" 80 "${gpu_tests[@]}" tests/gpu/test_hf_generator_gpu.py -k sleep
            fi
            run "$part" 510 env OUT="$OUT/real-scale" bash bench/real_scale_gpu.sh "$cell" \
                --budget-s 480 "${sides[@]}" "${tokens[@]}" ;;
    esac
done
