"""Compile safety fails closed (issue #14, item 8): on a torch whose internals a fix does not
recognise, several threads compiling at once are refused with a message naming the torch
version and the ways out; one thread, and this (tested) torch, pass.

Each case is a fresh interpreter (install_compile_safety patches torch process-wide). An
"unrecognised torch" is this torch with internals changed the way a new release could change
them, before the fixes are installed: a new reader of the FX tracing flag (the per-thread flag
fix would miss it) and dynamo's compile lock gone (masks could no longer be serialised with
compiles).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CASE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    if sys.argv[2] == "changed":
        import torch._dynamo.convert_frame as convert_frame
        import torch.fx._symbolic_trace as st
        exec("def _is_tracing_now():\\n    return _is_fx_tracing_flag\\n", vars(st))  # a new reader of the flag
        del convert_frame.compile_lock
    from dflash_train.errors import ConfigError
    from dflash_train.pipeline.compile_safety import check_threaded_compile_supported, install_compile_safety

    report = install_compile_safety()
    result = {"unrecognised": [f.name for f in report.unrecognised], "report": str(report)}
    check_threaded_compile_supported(1)  # one compiling thread: always allowed
    try:
        check_threaded_compile_supported(3)
        result["three_threads"] = "allowed"
    except ConfigError as error:
        result["three_threads"] = str(error)
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    script = tmp_path_factory.mktemp("fail-closed") / "case.py"
    script.write_text(CASE)
    changes = ("none", "changed")
    running = {c: subprocess.Popen([sys.executable, str(script), str(REPO), c], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for c in changes}
    results = {}
    for change, process in running.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        results[change] = json.loads(out.strip().splitlines()[-1])
    return results


def test_a_tested_torch_is_recognised_and_allows_threads(outcomes):
    import torch

    assert outcomes["none"]["unrecognised"] == [], outcomes["none"]["report"]
    assert outcomes["none"]["three_threads"] == "allowed"
    assert torch.__version__.startswith(("2.11", "2.12", "2.13")), "update TESTED_TORCH and pyproject's bound"


def test_an_unrecognised_torch_refuses_several_compiling_threads(outcomes):
    import torch

    result = outcomes["changed"]
    # The change breaks what the FX-flag fix reads always, and what the compile-flag and mask-lock
    # fixes read where this torch needs them (2.13: both; 2.11: neither is needed, so neither is
    # unrecognised).
    needed = [fix for fix in ("is_compiling_flag", "block_mask_lock") if f"[applied] {fix}" in outcomes["none"]["report"]]
    assert result["unrecognised"] == ["fx_tracing_flag", *needed], result["report"]
    for fix in result["unrecognised"]:
        assert "UNRECOGNISED] " + fix in result["report"]
    message = result["three_threads"]
    assert message.startswith(f"torch {torch.__version__}: the thread-safety fixes for torch.compile do not recognise "
                              f"this torch's internals (fx_tracing_flag: unsupported: unexpected users of "), message
    if "block_mask_lock" in needed:
        assert "block_mask_lock: " in message
    assert "3 threads compiling at once are not known to be safe" in message
    for way_out in ("one drafter thread", "--compile off --attention sdpa", "a tested torch (2.11 to 2.13"):
        assert way_out in message, message


def test_pyproject_bounds_torch_at_the_newest_tested_release():
    import tomllib

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.11,<2.14" in dependencies
