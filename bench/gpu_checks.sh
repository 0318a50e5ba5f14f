#!/usr/bin/env bash
# GPU checks behind docs/PERF.md and docs/RESULTS.md, run on the lent H200 machine from the
# repository root: `bash bench/gpu_checks.sh env tests step`. Each stage is time-boxed,
# logs to $OUT/<stage>.log and never stops the stages after it. DEADLINE_S (seconds from the start)
# shortens each stage's box to what is left and skips a stage with under 30 s left.
set -u
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/dflash-gpu}"
mkdir -p "$OUT"
stage() {
    local name=$1 limit=$2
    shift 2
    if [ -n "${DEADLINE_S:-}" ]; then
        local left=$(( DEADLINE_S - $(date +%s) + START ))
        if [ "$left" -lt 30 ]; then echo "=== $name skipped: ${left}s left of DEADLINE_S"; return; fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "=== $name (limit ${limit}s) $(date +%T)"
    # -k: on SIGTERM the trainer finishes its step first, which can be a minutes-long compile.
    # Test stages end with SIGABRT: with PYTHONFAULTHANDLER set, a hang leaves every thread's stack.
    local signal=${STAGE_SIGNAL:-TERM}
    [ "$3" = pytest ] && signal=ABRT
    PYTHONFAULTHANDLER=1 timeout -s "$signal" -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$OUT/$name.log"
    echo "=== $name rc=$rc $(date +%T)"
}
# Arguments of bench/quality_smollm2.py for the bar recipe (docs/RESULTS.md) with `--fp8 MODE`, trained on DEVICE and
# decoded on both GPUs, into the array QUALITY_ARGS (`timeout` runs commands, not shell functions).
quality_args() {
    local mode=$1 device=$2 json_dir=$3 limit=$4
    QUALITY_ARGS=(bench/quality_smollm2.py --gguf "$GGUF" --data "$DATA" --out "/tmp/q-$mode" --steps 2800
        --train-seconds 270 --device "$device" --eval-devices cuda:0,cuda:1 --eval-procs-per-device 12
        --eval-limit 40 --mtbench-every-other --deadline-seconds $(( limit - 15 )) --fp8 "$mode"
        --cache-dir /tmp/dflash-cache --json-dir "$json_dir")
}
# FlashAttention-4 (`train --attention flash`) into /tmp/flash-site, once per machine, from the wheels
# in FA4_WHEELS (bench/stage_flash.sh downloads them here and prints the calls that carry them).
# `pip install --target` skips cutlass's .pth file, so its dsl_packages folder goes on the path by hand.
install_flash_attention() {
    { [ -d /tmp/flash-site/flash_attn ] ||
        python3 -m pip install -q --no-index --no-deps --target /tmp/flash-site "${FA4_WHEELS:-.stage/fa4}"/*.whl; } &&
        export PYTHONPATH="$PYTHONPATH:/tmp/flash-site:/tmp/flash-site/nvidia_cutlass_dsl/dsl_packages" &&
        python3 -c "import flash_attn.cute.interface, cutlass; print('flash-attn-4 importable')"
}
# moved-tests: the GPU tests of every room the house move touched, one stage per group.
stages=()
for name in "$@"; do
    if [ "$name" = moved-tests ]; then stages+=(moved-core moved-graphs moved-hybrid nodes-nccl); else stages+=("$name"); fi
done
for name in "${stages[@]}"; do
    case "$name" in
        env) stage env 60 python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))" ;;
        tests) stage tests 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_core_attention.py tests/unit/test_core_drafter_parity.py \
            tests/integration/test_train_workers.py tests/integration/test_export_hf_reference.py tests/integration/test_train_compile_gate.py tests/integration/test_train_trainer.py ;;
        gpu-tests) stage gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests ;;
        step) stage step 240 python3 bench/drafter_step.py --configs A,B,D --profile A --profile-dir "$OUT" --json "$OUT/step.json" ;;
        # FP8 (train --fp8): A in every mode with a profile of each, then B and D with every product in FP8.
        fp8-a) stage fp8-a ${STEP_LIMIT:-300} python3 bench/drafter_step.py --configs A --fp8 off,head,all --profile A --profile-dir "$OUT" --json "$OUT/step_fp8_a.json" ;;
        fp8-bd) stage fp8-bd ${STEP_LIMIT:-300} python3 bench/drafter_step.py --configs D,B --fp8 ${FP8_MODES:-all} --json "$OUT/step_fp8_bd.json" ;;
        # The bar recipe trained with --fp8 (FP8_MODE, default all), decoded on both GPUs (needs GGUF= and DATA=).
        quality-fp8) quality_args "${FP8_MODE:-all}" cuda:0 "$OUT" ${QUALITY_LIMIT:-540}
            stage quality-fp8 ${QUALITY_LIMIT:-540} python3 "${QUALITY_ARGS[@]}" ;;
        # The same recipe for two modes at once (PAIR_MODES, default "off head"), trained one per GPU
        # (they share the host's CPUs, so their loop times are not comparable), each decoded on both GPUs.
        quality-fp8-pair) read -r first second <<<"${PAIR_MODES:-off head}"
            quality_args "$first" cuda:0 "$OUT/$first" ${QUALITY_LIMIT:-570}
            stage quality-fp8-$first ${QUALITY_LIMIT:-570} python3 "${QUALITY_ARGS[@]}" &
            quality_args "$second" cuda:1 "$OUT/$second" ${QUALITY_LIMIT:-570}
            stage quality-fp8-$second ${QUALITY_LIMIT:-570} python3 "${QUALITY_ARGS[@]}" &
            wait ;;
        # bf16 parameters with float32 master weights: the update against today's casts and fused AdamW (8B-shaped drafter).
        # train --master-weights on: its GPU test (graphed and eager, two replicas), then the 8B-shaped step with and
        # without it at STEP_CONFIGS (default A,D), STEP_GRAPHS (default off), one process.
        master-weights-tests) stage master-weights-tests ${TESTS_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/gpu/test_train_step_graphs_gpu.py -k master_weights ;;
        step-master) stage step-master ${STEP_LIMIT:-330} python3 bench/drafter_step.py --configs ${STEP_CONFIGS:-A,D} --head fused \
            --master-weights off,on --cuda-graphs ${STEP_GRAPHS:-off} --json "$OUT/step_master.json" ;;
        master-weights) stage master-weights ${MASTER_LIMIT:-150} python3 bench/master_weights.py --dims 8b --json "$OUT/master_weights.json" ;;
        step-eager-head) stage step-eager-head 120 python3 bench/drafter_step.py --configs A --head eager --json "$OUT/step_eager_head.json" ;;
        # Greedy identity of speculative vs target-only decoding per dtype (needs GGUF=path of the SmolLM2 GGUF).
        lossless) stage lossless 125 python3 bench/lossless_dtype.py --gguf "$GGUF" --prompts 12 --procs-per-device 6 \
            --deadline-seconds 112 --out /tmp/lossless --json-dir "$OUT" --cache-dir /tmp/dflash-cache ;;
        # Per-token cost of a verify step vs a target-only step, one decoder per GPU (uncontended).
        lossless-speed) stage lossless-speed 70 python3 bench/lossless_dtype.py --gguf "$GGUF" --dtypes bfloat16 --prompts 2 \
            --procs-per-device 1 --deadline-seconds 60 --out /tmp/lossless-speed --json-dir "$OUT/speed" --cache-dir /tmp/dflash-cache ;;
        flex) stage flex ${FLEX_LIMIT:-150} python3 bench/flex_tuning.py --config A --json "$OUT/flex.json" ;;
        # The drafter step again with the fastest flex options of the `flex` stage (skipped if none beat the default by 3%).
        step-best) best=$(python3 bench/flex_tuning.py --pick "$OUT/flex.json" 2>/dev/null)
            echo "best flex options: ${best:-default}"
            stage step-best ${STEP_LIMIT:-200} python3 bench/drafter_step.py --configs ${STEP_CONFIGS:-A,D} ${best:+--flex-options "$best"} --json "$OUT/step_best.json" ;;
        # Issue #3 item 7: target on cuda:0 -> one drafter on cuda:1; then 3 drafter threads sharing
        # the two GPUs (replicas), variable-length rows in two buckets, >= 200 steps each.
        layout1) stage layout1 150 python3 bench/pipeline.py --dims small --target-devices cuda:0 --drafter-devices cuda:1 \
            --steps 240 --batch-size 4 --min-seq-len 200 --max-seq-len 2048 --buckets 1024,2048 --num-anchors 256 --json "$OUT/layout1.json" ;;
        layout3) stage layout3 170 python3 bench/pipeline.py --dims small --target-devices cuda:0 --drafter-devices cuda:0,cuda:1,cuda:1 \
            --steps 220 --batch-size 4 --min-seq-len 200 --max-seq-len 2048 --buckets 1024,2048 --num-anchors 256 --json "$OUT/layout3.json" ;;
        # Issue #6 item 4: Qwen3-8B-shaped target on cuda:0 feeding a drafter on cuda:1 at config D.
        pipeline8b) stage pipeline8b ${PIPELINE_LIMIT:-150} python3 bench/pipeline.py --target-devices cuda:0 --drafter-devices cuda:1 --steps 30 --json "$OUT/pipeline8b.json" ;;
        # The row kernel of the batched generator's cache attention (target/row_attention_kernel.py) against the
        # biased attention, and the graphed generator with it against the eager one (auto's choice included).
        row-attention-tests) stage row-attention-tests ${TESTS_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/gpu/test_target_row_attention_gpu.py tests/integration/test_generate_engine.py ;;
        # Regeneration at 1,024 slots, the matmul attention against the row kernel, on the real prompts (PROMPTS=).
        regen-rows) stage regen-rows ${REGEN_LIMIT:-300} python3 bench/regenerate_speed.py --target "$GGUF" \
            --prompts "${PROMPTS:?PROMPTS= the prompts file}" --batches 1024 --engines ours --attention matmul,rows \
            --budget-s ${REGEN_BUDGET:-15} --json "$OUT/regen_rows.json" ;;
        # Issue #5: decode-step latency, static decoder (CUDA graphs) vs Hugging Face eager, at SmolLM2's and Qwen3-8B's shapes.
        # Regeneration speed (issue #21): ours vs HF generate on real SmolLM2 (needs GGUF=), then the 8B shape.
        # One call each (every case has an untimed warm-up, and hf-static compiles once per batch size).
        regen-speed) stage regen-speed ${REGEN_LIMIT:-570} python3 bench/regenerate_speed.py --target "$GGUF" --batches 64,256 --budget-s ${REGEN_BUDGET:-30} --json "$OUT/regen_smollm2.json" ;;
        regen-speed-1024) stage regen-speed-1024 ${REGEN_LIMIT:-570} python3 bench/regenerate_speed.py --target "$GGUF" --batches 1024 --budget-s ${REGEN_BUDGET:-30} --json "$OUT/regen_smollm2_1024.json" ;;
        regen-speed-8b) stage regen-speed-8b ${REGEN_LIMIT:-570} python3 bench/regenerate_speed.py --target "$GGUF" --dims qwen3-8b --batches 64,256 --budget-s ${REGEN_BUDGET:-30} --json "$OUT/regen_qwen3_8b.json" ;;
        decode-speed) stage decode-speed 100 python3 bench/static_decode_speed.py --dims smollm2 --json "$OUT/decode_speed_smollm2.json"
            stage decode-speed-8b 170 python3 bench/static_decode_speed.py --dims qwen3-8b --context 1000 --repeats 10 --new-tokens 64 --json "$OUT/decode_speed_qwen3.json" ;;
        # Issue #17: --cuda-graphs. GPU tests, the bar recipe graphed vs eager (needs GGUF= and DATA=),
        # the step alone at A and D both ways, the small pipeline both ways, and a second start's warm-up.
        graphs-tests) stage graphs-tests ${GRAPHS_LIMIT:-290} python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/gpu/test_train_step_graphs_gpu.py tests/integration/test_train_trainer.py ;;
        graphed-step) stage graphed-step ${GRAPHED_LIMIT:-290} python3 bench/graphed_step.py --gguf "$GGUF" --data "$DATA" \
            --steps ${GRAPHED_STEPS:-600} --run-timeout 120 --cache-dir /tmp/dflash-cache --json "$OUT/graphed_step.json" ;;
        step-graphs) stage step-graphs ${STEP_LIMIT:-290} python3 bench/drafter_step.py --configs ${STEP_CONFIGS:-A,D} \
            --cuda-graphs on,off --json "$OUT/step_graphs.json" ;;
        pipeline-graphs) stage pipeline-graphs ${PIPELINE_LIMIT:-290} python3 bench/pipeline.py --dims small --device cuda:0 \
            --steps 200 --batch-size 4 --min-seq-len 200 --max-seq-len 2048 --buckets 1024,2048 --num-anchors 256 \
            --cuda-graphs on,off --json "$OUT/pipeline_graphs.json" ;;
        starts) stage starts ${STARTS_LIMIT:-290} python3 bench/pipeline.py --dims small --device cuda:0 --steps 20 \
            --batch-size 4 --min-seq-len 200 --max-seq-len 2048 --buckets 512,1024,1536,2048 --num-anchors 256 \
            --cuda-graphs on --starts 2 --json "$OUT/starts.json" ;;
        # The slowed-target test, and the same case traced (kernel timeline per stream under $OUT): the
        # spin must be captured uncompiled (inductor drops it from a compiled forward).
        slowed-target) stage slowed-target 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/gpu/test_train_step_graphs_gpu.py -k slowed_target
            stage slowed-trace 150 python3 bench/pipeline.py --tiny --device cuda:0 --steps 30 --max-seq-len 256 --min-seq-len 30 \
                --num-anchors 32 --buckets 128,256 --slow-target-ms 40 --compile-target off --cuda-graphs on \
                --trace "$OUT/slowed" --json "$OUT/slowed.json" ;;
        # One stage per group, each test named (-v); a box that ends one writes every thread's stack (SIGABRT, above).
        moved-core) stage moved-core ${MOVED_LIMIT:-240} python3 -m pytest -v -p no:cacheprovider -m gpu \
            --durations=0 tests/gpu/test_core_dflash2_gpu.py tests/gpu/test_core_head_kernel_gpu.py tests/integration/test_core_fp8.py \
            tests/integration/test_data_feature_cache.py tests/integration/test_train_trainer.py \
            tests/integration/test_train_compile_gate.py ${CORE_K:+-k "$CORE_K"} ;;
        moved-graphs) stage moved-graphs ${MOVED_LIMIT:-240} python3 -m pytest -v -p no:cacheprovider -m gpu \
            --durations=0 tests/gpu/test_train_step_graphs_gpu.py tests/gpu/test_parallel_streams_gpu.py ${GRAPHS_K:+-k "$GRAPHS_K"} ;;
        moved-hybrid) stage moved-hybrid ${MOVED_LIMIT:-240} python3 -m pytest -v -p no:cacheprovider -m gpu \
            --durations=0 tests/gpu/test_target_hybrid_gpu.py ;;
        nodes-nccl) stage nodes-nccl 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/e2e/test_parallel_nodes.py -k nccl ;;
        selector) stage selector 120 python3 bench/selector_cost.py --json "$OUT/selector_cost.json" ;;
        decode-speed-dflash2) stage decode-speed-dflash2 150 python3 bench/static_decode_speed.py --dims smollm2 --arch dflash2 \
            --decoders static --json "$OUT/decode_speed_dflash2.json" ;;
        # Issue #35's speed-up: both drafters' decode steps with the drafter's forward compiled before capture.
        decode-speed-compiled) stage decode-speed-compiled 300 bash -c 'for arch in dflash dflash2; do
                python3 bench/static_decode_speed.py --dims smollm2 --arch $arch --decoders static --compile-draft \
                    --json "$0/decode_speed_${arch}_compiled.json" || exit; done' "$OUT" ;;
        hybrid-train) stage hybrid-train ${HYBRID_LIMIT:-400} python3 bench/hybrid_targets.py --device cuda:0 --family qwen3_5 \
            --steps 12 --train-batch 4 --max-seq-len 2048 --buckets 2048 --skip regenerate ;;
        # `--fp8 all` under graphs at recipe size (needs GGUF= and DATA=): its 2026-12-02 run printed no
        # step after warm-up; the bench writes every thread's stack before its box ends.
        graphed-fp8) stage graphed-fp8 ${GRAPHED_LIMIT:-290} python3 bench/graphed_step.py --gguf "$GGUF" --data "$DATA" \
            --steps ${GRAPHED_STEPS:-240} --run-timeout ${RUN_TIMEOUT:-120} --fp8 all --runs ${GRAPHED_RUNS:-fp8} --compile-target off \
            --cache-dir /tmp/dflash-cache --json "$OUT/graphed_fp8.json" ;;
        # The smollm2-quality recipe through `dflash-train pipeline` (needs GGUF= and PROMPTS=, the default prompt
        # set as `dflash-train prompts --split all` writes it: the lent machine has no evals registry; its train
        # and dev splits and their order are the built-in set's). WORK outlives the call on a warm machine, so the
        # same stage in the next call resumes it; Ctrl-C at the box lets training save its step. The records
        # come back under $OUT/quality-pipeline (records.tar.gz and the drafter). ARCH=dflash2 trains a DFlash2 drafter on the same recipe (its own WORK).
        # bench/stage_device.sh prepares here what the machine needs (the GGUF in halves, the prompts, the wheels, the
        # committed code) and prints the calls that carry it.
        quality-pipeline) WORK=${WORK:-$HOME/stage/${RECIPE:-smollm2-quality}-${ARCH:-recipe}}
            # DATA_PARTS= a folder of data.jsonl.xz.partNN an earlier call sent back: train on those answers
            # (`pipeline --data`) instead of writing them again, the recipe's first three stages skipped.
            DATA_ARGS=()
            if [ -n "${DATA_PARTS:-}" ]; then
                # One file per folder of parts: two sets carried to one machine are never mixed up.
                CARRIED="$HOME/stage/carried-$(basename "$DATA_PARTS").jsonl"
                mkdir -p "$HOME/stage"; [ -f "$CARRIED" ] || { cat "$DATA_PARTS"/data.jsonl.xz.part* | xz -dc >"$CARRIED.part" && mv "$CARRIED.part" "$CARRIED"; }
                DATA_ARGS=(--data "$CARRIED")
            fi
            # BUCKETS=256,384,512,768 pads each batch to the smallest of these that holds it instead of the recipe's one
            # 768: the same rows, order and anchors (batches group similar lengths whatever the buckets), less padding.
            # RECIPE= a built-in recipe (smollm2-quality, smollm2-fast), run as shipped but for the prompts file. ARCH=,
            # STEPS=, PROMPT_COUNT= and SELF_PROMPTS= change its [train] arch and steps and its [prompts] /
            # [self_prompts] counts (give such a run its own WORK). STAGES= runs only those stages (`pipeline
            # --stages`), so a call can end at a stage's end and the next start the next.
            EDITS=(-e "s|^source = \"default\".*|source = \"$PROMPTS\"|")
            # MASTER=on trains with --master-weights on (its acceptance cost: compare tau with a run without it);
            # before ARCH's edit, which changes the [train] line this one finds.
            [ -n "${MASTER:-}" ] && EDITS+=(-e "/^\[train\]\$/a master_weights = \"$MASTER\"")
            [ -n "${ARCH:-}" ] && EDITS+=(-e "/^arch = /d" -e "s|^\[train\]\$|[train]\narch = \"$ARCH\"|")
            [ -n "${BUCKETS:-}" ] && EDITS+=(-e "s|^seq_buckets = .*|seq_buckets = [$BUCKETS]|")
            # PACK=on trains with --pack-anchors on (no padded anchor slots; compare its train time and tau with a run without).
            [ -n "${PACK:-}" ] && EDITS+=(-e "/^\[train\]\$/a pack_anchors = \"$PACK\"")
            [ -n "${STEPS:-}" ] && EDITS+=(-e "s|^steps = .*|steps = $STEPS|")
            [ -n "${PROMPT_COUNT:-}" ] && EDITS+=(-e "/^\[prompts\]/,/^\[/s|^count = .*|count = $PROMPT_COUNT|")
            [ -n "${SELF_PROMPTS:-}" ] && EDITS+=(-e "/^\[self_prompts\]/,/^\[/s|^count = .*|count = $SELF_PROMPTS|")
            sed "${EDITS[@]}" "dflash_train/recipes/${RECIPE:-smollm2-quality}.toml" >/tmp/recipe-file.toml
            # WARM_AHEAD=off: the train stage compiles after regenerate, not beside it (`pipeline --warm-ahead`).
            STAGE_SIGNAL=INT TAIL=40 stage quality-pipeline ${PIPELINE_LIMIT:-570} python3 -m dflash_train.cli pipeline \
                --target "$GGUF" --recipe /tmp/recipe-file.toml --out "$WORK" --device cuda:0 "${DATA_ARGS[@]}" \
                ${STAGES:+--stages "$STAGES"} --warm-ahead "${WARM_AHEAD:-auto}"
            mkdir -p "$OUT/quality-pipeline"
            # The target's answers, once, in 15 MiB pieces: a later session carries them back (DATA_PARTS=) and
            # only trains, for the device time one session has is less than the whole recipe takes. SEND_DATA=0: not sent.
            if [ "${SEND_DATA:-1}" = 1 ] && [ -f "$WORK/data.jsonl" ] && [ ! -f "$WORK/.data-sent" ] && python3 -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1])).get("regenerate", {}).get("done"))' "$WORK/stages.json" 2>/dev/null; then
                xz -T0 -6 -c "$WORK/data.jsonl" | split -b 15M -d - "$OUT/quality-pipeline/data.jsonl.xz.part" && touch "$WORK/.data-sent"
            fi
            (cd "$WORK" && tar czf "$OUT/quality-pipeline/records.tar.gz" \
                $(ls stages.json train.json eval.json speed.json training_curve.png run/metrics.jsonl warm-ahead.log 2>/dev/null))
            # The exported drafter in 15 MiB pieces (a call sends back 8 files of 16 MiB), so a later call can carry
            # it back to time its decoding on another card without training it again: cat drafter.tar.part* | tar x
            [ -f "$WORK/drafter/config.json" ] && tar cf - -C "$WORK" drafter | split -b 15M -d - "$OUT/quality-pipeline/drafter.tar.part" ;;
        # Issue #35: DFlash2's selector weight, 0.5 / 1.0 (base) / 2.0, trained from one target stream on 30k of
        # 40k answers for 3,000 steps, ranked by tau on 40 dev prompts (needs GGUF=, PROMPTS= and DEV= the
        # `dflash-train prompts --split dev` file); resumable: the same command continues in the next call.
        selector-weight) stage selector-weight ${SWEEP_LIMIT:-570} python3 bench/quality_run.py run --target "$GGUF" \
            --prompts "${PROMPTS:?PROMPTS= the prompts file}" --dev-prompts "${DEV:?DEV= the dev prompts file}" \
            --work "${WORK:-$HOME/stage/selector-weight}" --samples 40000 --self-prompts 11000 --arch dflash2 \
            --stages prompts,self-prompts,regenerate,recipe --recipe-rows 30000 --recipe-steps 3000 \
            --recipe-variants selector_weight=0.5,selector_weight=2.0 --deadline-seconds $(( ${SWEEP_LIMIT:-570} - 20 )) \
            --no-send-back --json-dir "$OUT" ;;
        # The compiled feature forward against float32 and the eager one, at the smollm2-quality recipe's shape.
        feature-compile-error) stage feature-compile-error 200 python3 bench/feature_compile_error.py --device cuda:0 \
            --target "${GGUF:?GGUF= the SmolLM2 GGUF}" --name SmolLM2 --json "$OUT/feature_compile_error.json" ;;
        # The smollm2-quality recipe's drafter step, DFlash and DFlash2, eager (kernel profile) and graphed.
        step-recipe) stage step-recipe ${STEP_LIMIT:-300} python3 bench/drafter_step.py --dims smollm2 --configs S --head fused \
            --arch ${STEP_ARCH:-dflash,dflash2} --cuda-graphs off,on --profile S --profile-dir "$OUT" --json "$OUT/step_recipe.json" ;;
        # The GPU tests of the compiled draft and of DFlash2's training step and decoding (the whole log in $OUT).
        dflash2-tests) stage dflash2-tests ${TESTS_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/integration/test_decode_static.py tests/gpu/test_core_dflash2_gpu.py -k "compiled or dflash2" ;;
        # The pipeline's warm-up ahead on CUDA (the train stage's compiles all cache hits) and the tiny recipe on the GPU.
        warm-ahead-tests) stage warm-ahead-tests ${TESTS_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/e2e/test_pipeline_warm_ahead.py tests/e2e/test_commands_pipeline.py ;;
        # Packed anchors (train --pack-anchors): the recipe's step graphed at its micro-batches' mean fill, padded and packed,
        # then the GPU test (every capacity captured, losses follow the padded run's).
        step-packed) stage step-packed ${STEP_LIMIT:-300} python3 bench/drafter_step.py --dims smollm2 --configs S --head fused \
            --cuda-graphs on --valid-anchors ${VALID_ANCHORS:-1583} --pack-anchors off,on --json "$OUT/step_packed.json"
            stage packed-tests ${TESTS_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/gpu/test_train_step_graphs_gpu.py -k packed ;;
        # The fused head kernel against the reference, its slice maxima (DFlash2's candidates) and its probe included.
        head-kernel-tests) stage head-kernel-tests ${TESTS_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/gpu/test_core_head_kernel_gpu.py ;;
        # DFlash2's training candidates: torch.topk over whole rows against row_top_k's slice maxima, SmolLM2's and Qwen3's vocabularies.
        selector-top-k) stage selector-top-k 120 bash -c 'python3 bench/selector_top_k.py --json "$0/top_k_smollm2.json" &&
                python3 bench/selector_top_k.py --vocab 151936 --rows 8000 --json "$0/top_k_qwen3.json"' "$OUT" ;;
        # Issue #40 item 1: the Qwen3-8B-shaped step as train runs it on CUDA (the fused head), with a kernel profile of A.
        step-fused) stage step-fused ${STEP_LIMIT:-300} python3 bench/drafter_step.py --configs A,D --head fused --profile A \
            --profile-dir "$OUT" --json "$OUT/step_fused.json" ;;
        # The 8B-shaped step graphed (gradient buffers) against eager with handed-over gradients and with buffers, one process.
        step-gradients) stage step-gradients ${STEP_LIMIT:-300} python3 bench/drafter_step.py --configs A --head fused \
            --cuda-graphs on,off --gradients handed-over,buffers --json "$OUT/step_gradients.json" ;;
        # flex attention on FlashAttention-4's kernels against Triton's at FLEX_CONFIG (A; S with FLEX_DIMS=smollm2),
        # then the drafter step on each, one process: STEP_CONFIGS (default A,D) at STEP_DIMS (default 8b), STEP_GRAPHS
        # (off; on,off: both), STEP_FP8 (off; all, or off,all: both).
        flash) install_flash_attention && stage flash ${FLEX_LIMIT:-240} python3 bench/flex_tuning.py --config ${FLEX_CONFIG:-A} \
            --dims ${FLEX_DIMS:-8b} --only default,flash --json "$OUT/flash.json" ;;
        step-flash) install_flash_attention && stage step-flash ${STEP_LIMIT:-300} python3 bench/drafter_step.py --configs ${STEP_CONFIGS:-A,D} \
            --dims ${STEP_DIMS:-8b} --head fused --attention flex,flash --cuda-graphs ${STEP_GRAPHS:-off} --fp8 ${STEP_FP8:-off} \
            --json "$OUT/step_flash${STEP_FP8:+_fp8-$STEP_FP8}.json" ;;
        step-eager) stage step-eager 240 python3 bench/drafter_step.py --configs A --compile off --json "$OUT/step_eager.json" ;;
        *) echo "unknown stage $name" ;;
    esac
done
