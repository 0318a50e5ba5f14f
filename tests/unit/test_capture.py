"""One checked capture, one walk of the target's layers, one probe (capture.py, target/walk.py,
target/probe.py): each made structural, then proven on what it does."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tiny import tiny_target

from dflash_train.capture import GraphPool, checked_capture
from dflash_train.target import probe

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_train"


def _calls(path: Path) -> list[tuple[int, str]]:
    """(line, the called expression) of every call in a module, e.g. `torch.cuda.graph`."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, ast.unparse(node.func)) for node in ast.walk(tree) if isinstance(node, ast.Call)]


def test_every_cuda_graph_is_made_by_the_checked_capture():
    """Only capture.py records graphs (`torch.cuda.graph`, `CUDAGraph`, `capture_begin`, its raw
    `capture`); every other module captures through `checked_capture` or `CapturedStep`, so no
    graph is used without a replay check and a reason when it runs eagerly."""
    raw = ("cuda.graph", "CUDAGraph", "capture_begin", "graph_pool_handle")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "capture.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("capture"):
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports capture" for a in node.names if a.name == "capture"]
        found += [f"{path.relative_to(PACKAGE)}:{line} calls {name}" for line, name in _calls(path)
                  if name.endswith(raw) or name in ("capture", "graph_capture.capture")]
    assert not found, found


def test_one_module_walks_the_target_layers():
    """The embedding and rotary embedding of the target's body are called in target/walk.py only:
    training's features and the static-cache forward are one walk, not two copies of it."""
    found = [f"{path.relative_to(PACKAGE)}:{line} calls {name}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != PACKAGE / "target" / "walk.py"
             for line, name in _calls(path) if name.endswith((".embed_tokens", ".rotary_emb"))]
    assert not found, found


def test_one_probe_run_decides_both_uses_of_the_walk(monkeypatch):
    """Asking whether the feature forward and the static forward run a model builds one replica:
    one probe, one verdict per model, cached (a second model is probed on its own)."""
    built = []
    replica = probe.float32_replica
    monkeypatch.setattr(probe, "float32_replica", lambda model, device: built.append(device) or replica(model, device))
    target = tiny_target("qwen3")
    assert probe.feature_forward_unsupported(target, 12) is None
    assert probe.static_unsupported(target, 512) is None
    assert probe.feature_forward_unsupported(target, 40) is None and probe.static_unsupported(target, 1024) is None
    assert built == [torch.device("cpu")]
    hybrid = tiny_target("qwen3_next")
    assert probe.static_unsupported(hybrid, 512) is None  # its linear-attention states run over the static caches too
    assert probe.feature_forward_unsupported(hybrid, 12) is None
    assert len(built) == 2


@pytest.mark.gpu
def test_a_graph_that_fails_its_check_is_dropped_with_the_reason_and_its_pool_stays_usable():
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    x = torch.arange(8.0, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        (x * 2).sum()  # the warm-up a capture needs

    def replays(factor: float):
        def check(graph, out):
            out.zero_()
            graph.replay()
            return None if torch.equal(out, x * factor) else f"replayed {out.tolist()}"
        return check

    pool = GraphPool()
    refused = checked_capture(lambda: x * 2, device, stream, lambda graph, out: "differs on purpose", pool)
    assert refused.graph is None and refused.reason == "differs on purpose"
    kept = checked_capture(lambda: x * 3, device, stream, replays(3.0), pool)  # the dropped graph's pool: a fresh one
    assert kept.reason is None and kept.graph is not None
    unchecked = checked_capture(lambda: x * 4, device, stream, None, pool)
    x.add_(1)
    kept.graph.replay()
    unchecked.graph.replay()
    assert torch.equal(kept.outputs, x * 3) and torch.equal(unchecked.outputs, x * 4)
