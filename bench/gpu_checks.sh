#!/usr/bin/env bash
# GPU checks behind docs/PERF.md and docs/RESULTS.md, run on the lent H200 machine from the
# repository root: `bash bench/gpu_checks.sh env tests race step`. Each stage is time-boxed,
# logs to $OUT/<stage>.log and never stops the stages after it.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/dflash-gpu}"
mkdir -p "$OUT"
stage() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$OUT/$name.log"
    echo "=== $name rc=$rc $(date +%T)"
}
for name in "$@"; do
    case "$name" in
        env) stage env 60 python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))" ;;
        tests) stage tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_parity.py \
            tests/test_pipeline.py tests/test_reference.py tests/test_compile_safety.py ;;
        race) stage race 180 python3 bench/compile_race_gpu.py --smoke --devices cuda:0,cuda:1 --json "$OUT/race.json" ;;
        step) stage step 240 python3 bench/drafter_step.py --configs A,B,D --json "$OUT/step.json" ;;
        step-eager) stage step-eager 240 python3 bench/drafter_step.py --configs A --compile off --json "$OUT/step_eager.json" ;;
        *) echo "unknown stage $name" ;;
    esac
done
