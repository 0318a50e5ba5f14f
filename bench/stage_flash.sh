#!/usr/bin/env bash
# FlashAttention-4 (`train --attention flash`) for the lent GPU machine, which has no registry:
# downloads its wheels here into the ignored folder .stage/fa4/ (cp312, CUDA 13, as that machine's
# torch 2.11+cu130), splits the one that is too large for a call, and prints the two calls that
# install it there for `bash bench/gpu_checks.sh flash step-flash`. Run from the repository root:
# `bash bench/stage_flash.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
# The versions measured in docs/PERF.md; torch brings cuda-bindings.
wheels=(flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2 protobuf==7.36.2)
large=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
mkdir -p .stage/fa4
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform any -d .stage/fa4 "${wheels[@]}"
# A call carries at most 64 MiB: the first 56 MiB go alone, the rest with the other wheels.
split -b 56M -d ".stage/fa4/$large" .stage/fa4-cu13.part
mv .stage/fa4-cu13.part01 .stage/fa4/ && rm ".stage/fa4/$large"
ls -l .stage/fa4 .stage/fa4-cu13.part00
cat <<EOF

Calls, back to back on one machine (it goes back after ~30 s idle):
 1. carry .stage/fa4-cu13.part00:
    mkdir -p ~/stage && cp .stage/fa4-cu13.part00 ~/stage/
 2. carry .stage/fa4:
    mkdir -p /tmp/fa4 && cp .stage/fa4/*.whl /tmp/fa4/ && cat ~/stage/fa4-cu13.part00 .stage/fa4/fa4-cu13.part01 > /tmp/fa4/$large && FA4_WHEELS=/tmp/fa4 bash bench/gpu_checks.sh flash step-flash
EOF
