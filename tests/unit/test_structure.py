"""The package's shape: no import circle, no room importing a room above it, a core that knows
nothing of threads, files or the CLI, and a `--help` that loads neither torch nor transformers.

The import graph is read statically (ast), with every import counted, including those inside
functions: a lazy import that climbs a floor is still a lower room knowing a higher one.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_train"

# Floors, top to bottom (docs/ARCHITECTURE.md): a module may import its own floor or lower ones.
# A dotted prefix names every module under it ("train" covers train.trainer, ...).
FLOORS = {
    "commands": 10,  # one module per CLI command
    "cli": 9,  # the static command table
    "train": 8,  # the training run: build steps, workers, coordinator, reporting, step graphs, checkpoints
    "parallel": 7,  # threads and streams, nodes: launch, liveness, gradient reduction, the stop vote
    "eval": 6,  # benchmarks, tau statistics, the in-training evaluator, the eval driver
    "generate": 6,  # answers for training: the batched engine, regeneration, endpoints, self-prompts
    "decode": 5,  # speculative decoding: Hugging Face, static (CUDA graphs), the loop, rollback
    "export": 4,  # a drafter written for engines: Hugging Face folder, GGUF, the loader rules
    "core": 3,  # the drafter, the mask, the objective, one training step
    "data": 3,  # rows, rendering, samples, the feature cache; data/prompts: prompt sets
    "target": 2,  # the frozen target: loading (Hugging Face or GGUF), its layer walk and the walk's probe
    # the bottom: settings, errors, files, worker processes, progress, recipes, the checked CUDA-graph capture
    "config": 1, "errors": 1, "files": 1, "processes": 1, "progress": 1, "assets": 1, "recipe": 1, "capture": 1, "": 1,  # "" = __init__
}
CORE = ("core.attention", "core.drafter", "core.dflash2", "core.objective", "core.step", "core.fp8",
        "core.head_kernel")
# What the core must not touch: threads, files and processes, the command line.
NOT_FOR_THE_CORE = {"threading", "queue", "os", "pathlib", "shutil", "tempfile", "json", "signal", "subprocess",
                    "argparse", "sys"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(package modules imported, top-level outside modules imported) by one module."""
    inside, outside = set(), set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "dflash_train" or alias.name.startswith("dflash_train."):
                    inside.add(alias.name.removeprefix("dflash_train").lstrip("."))
                else:
                    outside.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if name else []
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "dflash_train" or (node.module or "").startswith("dflash_train."):
                target = node.module.removeprefix("dflash_train").lstrip(".")
            else:
                outside.add((node.module or "").split(".")[0])
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}" if target else alias.name
                inside.add(candidate if candidate in MODULES else target)
    resolved = set()
    for target in inside:
        while target not in MODULES:  # `from .x import y` where y is a name in module x
            target = target.rpartition(".")[0]
        if target != name:
            resolved.add(target)
    return resolved, outside


GRAPH = {name: _imports(name, path)[0] for name, path in MODULES.items()}


def floor_of(module: str) -> int:
    for prefix in sorted(FLOORS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + ".") or prefix == "" and module == "":
            return FLOORS[prefix]
    raise AssertionError(f"dflash_train.{module} has no floor in FLOORS: add it to the table in {__file__}")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_has_a_floor():
    for module in MODULES:
        floor_of(module)


def test_no_room_imports_a_room_above_it():
    climbs = [f"dflash_train.{a or '__init__'} (floor {floor_of(a)}) imports dflash_train.{b} (floor {floor_of(b)})"
              for a, targets in GRAPH.items() for b in targets if floor_of(b) > floor_of(a)]
    assert not climbs, "\n".join(climbs)


def test_no_import_circle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, " -> ".join(cycle)


def test_the_checks_can_fail():
    """The walkers see what they must: a circle in a made-up graph, a climb in the real one
    if the table said so, and the imports of a real module."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "train.build" in GRAPH["train.trainer"]
    assert "target.model" in GRAPH["core.drafter"] and floor_of("core.drafter") > floor_of("target.model")
    assert {"commands.cache_features", "train.trainer"} <= GRAPH["commands._stages"]  # lazy imports count


def test_the_core_knows_nothing_of_threads_files_or_the_cli():
    for module in CORE:
        _, outside = _imports(module, MODULES[module])
        assert not outside & NOT_FOR_THE_CORE, f"dflash_train.{module} imports {sorted(outside & NOT_FOR_THE_CORE)}"
        assert all(t.startswith(("core.", "target.")) or floor_of(t) < floor_of("target")
                   for t in GRAPH[module]), (module, GRAPH[module])


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["eval", "--help"], ["quickstart", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    code = (
        "import sys\n"
        "from dflash_train.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy', 'safetensors') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert "usage: dflash-train" in done.stdout
    assert "HEAVY []" in done.stdout, done.stdout[-400:]


BENCH_IMPORT = re.compile(r"""^\s*(from|import)\s+bench\b|import_module\(\s*["']bench\.|sys\.path\.\w+\(.*["']bench["']""", re.M)


def bench_importers(files) -> list[str]:
    return sorted(str(path) for path in files if BENCH_IMPORT.search(path.read_text()))


def test_neither_the_package_nor_the_tests_import_bench():
    """bench/ measures the product; what the product does is proved against the product. A bench
    script's smoke test runs it as a subprocess (tests/e2e/test_bench_scripts.py), never imports it."""
    tests = Path(__file__).resolve().parent.parent
    assert bench_importers(PACKAGE.rglob("*.py")) == []
    assert bench_importers(p for p in tests.rglob("*.py") if p.resolve() != Path(__file__).resolve()) == []


def test_the_bench_import_check_can_fail(tmp_path):
    for line in ("from bench.profiling import kernels_by_stream", "import bench.head_ce",
                 'script = importlib.import_module("bench.spec_decode")',
                 'sys.path.insert(0, str(REPO / "bench"))'):
        (tmp_path / "t.py").write_text(f"import sys\n{line}\n")
        assert bench_importers([tmp_path / "t.py"]) == [str(tmp_path / "t.py")], line
    (tmp_path / "t.py").write_text('summary = data["benchmarks"]  # bench/spec_decode.py writes this\n')
    assert bench_importers([tmp_path / "t.py"]) == []
