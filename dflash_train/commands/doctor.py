"""`dflash-train doctor`: will a run work on this machine? Versions, compile gate, GPUs, disk, target.

One screen of findings; exit 1, with the reasons, when something a run needs is missing. Every
check runs the real thing where it can (a bf16 and an FP8 product per GPU, a compiled flex
attention forward+backward, the compile gate's and the static decoder's probes) instead of
trusting names.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

from ..config import option

MIN_TORCH = (2, 11)
MIN_TRANSFORMERS = (5, 0)
MIN_PYTHON = (3, 10)
MIN_FREE_GIB = 1.0  # less than this under the cache or --out is a failure: checkpoints and caches need room
PROBE_TOKENS = 2048  # prompt + new tokens of a typical eval: the length the static decoder's probe is judged at


@dataclasses.dataclass
class DoctorConfig:
    target: str = option("", "a target (Hugging Face folder or .gguf): load its config and run the static decoder's probe")
    out: str = option("", "a folder a run will write (a run folder, an export): report its free disk")

    def validate(self) -> None:
        pass  # both optional; a path that is not there is a finding, not an input error


class Finding(NamedTuple):
    status: str  # "ok", "FAIL" (a run needs it), "info" (worth knowing) or "skip"
    name: str
    detail: str


def _version_tuple(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions() -> list[Finding]:
    import torch
    import transformers

    found = []
    python = ".".join(map(str, sys.version_info[:3]))
    found.append(Finding("ok" if sys.version_info[:2] >= MIN_PYTHON else "FAIL", "python",
                         python if sys.version_info[:2] >= MIN_PYTHON else f"{python}: dflash-train needs Python >= 3.10"))
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    torch_ok = _version_tuple(torch.__version__) >= MIN_TORCH
    found.append(Finding("ok" if torch_ok else "FAIL", "torch",
                         f"{torch.__version__} ({build})" + ("" if torch_ok else ": dflash-train needs torch >= 2.11")))
    transformers_ok = _version_tuple(transformers.__version__) >= MIN_TRANSFORMERS
    found.append(Finding("ok" if transformers_ok else "FAIL", "transformers", transformers.__version__
                         + ("" if transformers_ok else ": dflash-train needs transformers >= 5")))
    triton = _package_version("triton") or _package_version("pytorch-triton")
    if triton:
        found.append(Finding("ok", "triton", triton))
    elif torch.cuda.is_available():
        found.append(Finding("FAIL", "triton", "not installed: torch.compile (flex attention, the compiled drafter) needs it on CUDA"))
    else:
        found.append(Finding("info", "triton", "not installed (needed only for torch.compile on CUDA)"))
    return found


def check_compile_gate() -> list[Finding]:
    """Does this torch hold the compile gate (train/compile_gate.py)? Probed, not looked up."""
    from ..train.compile_gate import gate_problem

    problem = gate_problem()
    if problem is not None:
        return [Finding("FAIL", "compile gate", f"this torch cannot hold it: {problem}")]
    return [Finding("ok", "compile gate", "compiles are counted; after the warm-up a new shape runs eagerly, "
                    "or fails with --fail-on-recompile")]


def _bf16_product_error(device) -> str | None:
    import torch

    a = torch.randn(64, 64, device=device)
    b = torch.randn(64, 64, device=device)
    try:
        product = (a.bfloat16() @ b.bfloat16()).float()
    except (RuntimeError, TypeError) as error:
        return f"bf16 products do not run: {str(error).splitlines()[0]}"
    if not torch.allclose(product, a @ b, rtol=0.05, atol=0.5):
        return "a bf16 product gave a wrong result"
    return None


def check_gpus() -> list[Finding]:
    import torch

    from ..core.fp8 import fp8_unsupported

    if not torch.cuda.is_available():
        return [Finding("info", "GPU", "no CUDA GPU: training and eval run on the CPU (slow; fine for quickstart)")]
    found = []
    count = torch.cuda.device_count()
    for index in range(count):
        device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(index)
        bf16 = _bf16_product_error(device)
        fp8 = fp8_unsupported(device)
        detail = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor}; "
                  f"bf16 {'yes' if bf16 is None else 'NO (' + bf16 + ')'}; "
                  f"FP8 {'yes (--fp8 head/all)' if fp8 is None else 'no (' + fp8 + ')'}")
        found.append(Finding("ok" if bf16 is None else "FAIL", f"cuda:{index}", detail
                             + ("" if bf16 is None else "; train with --precision fp32")))
    if count > 1:
        pairs = [f"{i}->{j} {'yes' if torch.cuda.can_device_access_peer(i, j) else 'no'}"
                 for i in range(count) for j in range(count) if i != j]
        missing = sum(p.endswith("no") for p in pairs)
        found.append(Finding("ok" if not missing else "info", "peer access",
                             ", ".join(pairs) + ("" if not missing else " (features between those GPUs go through the host)")))
    return found


def check_flex(backend: str = "flex") -> list[Finding]:
    """The drafter's attention: flex with the DFlash block mask, compiled, forward and backward,
    compared with SDPA on the dense mask; on Triton's kernels (`flex`) or FlashAttention-4's (`flash`)."""
    import torch

    from ..core.attention import attend, dense_mask, flash_kernels_missing, make_mask

    name = "flex attention" if backend == "flex" else "flash kernels"
    if backend == "flash" and (missing := flash_kernels_missing()):
        return [Finding("skip", name, f"--attention flash needs FlashAttention-4: {missing}")]
    if not torch.cuda.is_available():
        return [Finding("skip", name, "no CUDA: flex attention's backward is not implemented on CPU; "
                        "training there uses SDPA (--attention auto)")]
    if backend == "flash" and torch.cuda.get_device_capability(0)[0] < 9:
        return [Finding("skip", name, "cuda:0 is older than Hopper: FlashAttention-4 does not train there (--attention flex)")]

    device = torch.device("cuda", 0)
    generator = torch.Generator(device=device).manual_seed(0)
    context, block = 128, 16
    anchors = torch.tensor([[0, 40, 80, 100]], device=device)
    queries, keys = anchors.shape[1] * block, context + anchors.shape[1] * block

    def tensor(heads: int, length: int) -> torch.Tensor:
        return torch.randn(1, heads, length, 64, device=device, generator=generator).bfloat16().requires_grad_()

    q, k, v = tensor(4, queries), tensor(2, keys), tensor(2, keys)
    start = time.perf_counter()
    out = attend(q, k, v, make_mask(backend, anchors, context, block), scale=0.125)
    out.float().square().sum().backward()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    reference = attend(q.detach(), k.detach(), v.detach(), dense_mask(anchors, context, block), scale=0.125)
    error = float((out.detach().float() - reference.float()).abs().max())
    if error > 0.05 or q.grad is None or not torch.isfinite(q.grad).all():
        return [Finding("FAIL", name, f"compiled flex disagrees with SDPA by {error:.3g} (or no finite gradient)")]
    return [Finding("ok", name, f"compiled forward+backward on cuda:0 in {seconds:.1f} s "
                    f"(first compile; matches SDPA to {error:.1g})")]


def _free_gib(path: Path) -> tuple[Path, float]:
    existing = path.resolve()
    while not existing.exists():
        existing = existing.parent
    return existing, shutil.disk_usage(existing).free / 2**30


def check_disk(out: str) -> list[Finding]:
    from ..errors import UserError
    from ..files import check_outside_inputs
    from ..target.gguf import default_cache_dir

    found = []
    for name, path in (("disk: cache", default_cache_dir()), *([("disk: --out", Path(out))] if out else [])):
        if path.exists() and not path.is_dir():
            found.append(Finding("FAIL", name, f"{path} is a file, not a folder"))
            continue
        if name == "disk: --out":
            try:  # the rule the commands hold --out to (a path below a file, `-`): what they refuse, refused here
                check_outside_inputs(out, "--out")
            except UserError as error:
                found.append(Finding("FAIL", name, str(error)))
                continue
        existing, free = _free_gib(path)
        where = str(path) if existing == path.resolve() else f"{path} (not there yet; {existing})"
        ok = free >= MIN_FREE_GIB
        found.append(Finding("ok" if ok else "FAIL", name, f"{free:.1f} GiB free at {where}"
                             + ("" if ok else f": below {MIN_FREE_GIB:.0f} GiB, checkpoints and caches will not fit")))
    return found


def check_target(target: str) -> list[Finding]:
    """The target's config (architecture, dims) and the static decoder's probe, which judges the
    model class and config on its own 2-layer random replica: no weights are loaded."""
    from ..config import ModelSettings
    from ..decode.loop import static_refusal_of_config
    from ..errors import UserError
    from ..target.model import TargetSpec, check_target_path, target_config

    path = Path(target)
    try:
        check_target_path(path)  # what train, eval and the rest refuse before loading, refused here too
        config = target_config(path)
        spec = TargetSpec.from_hf_config(config)
    except UserError as error:
        return [Finding("FAIL", "target", str(error))]
    except (OSError, ValueError, KeyError) as error:
        return [Finding("FAIL", "target", f"{target}: {str(error).splitlines()[0]}")]
    found = [Finding("ok", "target", f"{type(config).__name__}: {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
                     f"vocab {spec.vocab_size}")]
    # Blocks of train's default size: the drafter a typical eval decodes with.
    refusal = static_refusal_of_config(config, PROBE_TOKENS, ModelSettings.block_size)
    found.append(Finding("ok" if refusal is None else "info", "static decoder",
                         "passes its probe (eval --decoder auto uses it)" if refusal is None
                         else f"refused: {refusal}; eval falls back to Hugging Face decoding"))
    return found


def _guarded(check: Callable[[], list[Finding]], name: str) -> list[Finding]:
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - a broken check is itself a finding; the doctor must finish
        return [Finding("FAIL", name, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")]


def run_doctor(config: DoctorConfig) -> int:
    print("dflash-train doctor: will a run work here?")
    checks: list[tuple[str, Callable[[], list[Finding]]]] = [
        ("versions", check_versions),
        ("compile gate", check_compile_gate),
        ("GPU", check_gpus),
        ("flex attention", check_flex),
        ("flash kernels", lambda: check_flex("flash")),
        ("disk", lambda: check_disk(config.out)),
    ]
    if config.target:
        checks.append(("target", lambda: check_target(config.target)))
    else:
        checks.append(("target", lambda: [Finding("skip", "static decoder", "no --target given")]))
    findings = []
    for name, check in checks:
        for finding in _guarded(check, name):
            findings.append(finding)
            print(f"  {finding.status:<4}  {finding.name:<15} {finding.detail}", flush=True)
    problems = [f for f in findings if f.status == "FAIL"]
    if problems:
        print(f"not ready: {len(problems)} problem{'s' * (len(problems) > 1)}: "
              + "; ".join(f"{f.name}: {f.detail}" for f in problems))
        return 1
    print("ready: nothing a run needs is missing")
    return 0
