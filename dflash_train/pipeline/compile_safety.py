"""Make ``torch.compile`` usable from several Python threads of one process.

The trainer runs one target worker thread and one drafter worker thread per GPU
(several may share a device); each drafter thread calls ``torch.compile``d
flex-attention forward+backward and builds flex block masks.  ``torch.compile``
is not thread-safe.  This module installs the fixes the *running* torch needs
(2.11 to current) and explains what it did.  Every fix is gated on what the
installed torch actually contains or does, never on its version string.  A fix
that finds internals it does not know (an unexpected reader of a flag, a hook
that moved) says so (``FixResult.recognised`` False) instead of passing as "not
needed", and ``check_threaded_compile_supported`` then refuses to let several
threads compile: fail closed, not open.

Public API
----------
``install_compile_safety(...) -> SafetyReport``
    Call once in the main thread before any worker starts; idempotent.  The
    report (``str()`` it, or ``verbose=True``) lists each fix as applied or
    skipped, with the reason.
``configure_worker_thread(dynamo=..., inductor=...)``
    Call first thing inside every worker thread (applies config there).
``build_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE=128)``
    ``create_block_mask`` that cannot race another thread's compile.
``cudagraphs_allowed_in_threads() -> (bool, reason)``
``mark_warmup_done(fail_on_recompile=None)`` / ``recompile_snapshot()``
    Per-thread compile counter; ``RecompileAfterWarmupError`` on fail-fast.
``recompile_limit_for(num_shape_buckets, num_threads) -> int``
``check_threaded_compile_supported(threads, report=None)``
    Fail closed: ConfigError when more than one thread would compile on a torch
    whose internals a fix does not recognise (``SafetyReport.unrecognised``).

The fixes
---------
1. ``fx_tracing_flag`` (torch 2.11-2.13).  ``torch.fx._symbolic_trace._is_fx_tracing_flag``
   is a process global set by every ``fx.Tracer.trace`` - user/library
   ``symbolic_trace`` *and AOTAutograd's make_fx inside every compile*.
   Dynamo's compiled-call wrapper checks it on *every* call of a compiled
   function and raises "Detected that you are using FX to symbolically trace a
   dynamo-optimized function" if set: one thread compiling makes another
   thread's compiled call fail.  2.14 made it thread-local.  Detection: the
   attribute is a plain ``bool`` module global and the module's only functions
   using it are the known readers and writer (checked by bytecode).  Fix: a
   ``threading.local`` behind (a) a property on the module's class, for
   attribute access from other modules (``_set_compilation_env``), (b) the
   readers ``is_fx_tracing``/``is_fx_symbolic_tracing``, whose ``__code__`` is
   replaced in place (every existing reference keeps working), (c) a wrapper
   on ``Tracer.trace`` (its own writes to the module global become dead).
   ``is_compiling_flag`` (2.13+).  ``torch.compiler.is_compiling()`` returns a
   process global that *any* thread's dynamo compile sets for its duration, so
   eager code in other threads (transformers' ``is_torchdynamo_compiling``,
   our target model) takes compile-only branches meanwhile.  This is also what
   hides the FX-flag race on 2.13.  Same technique (``is_compiling`` and
   ``_compile_session_context``); applied only once the FX flag is per-thread.
   Detection: ``_compile_session_context`` writes the global.
   ``inductor_fx_trace`` (all versions): inductor FX-symbolic-traces a dummy
   function once per process (``loop_body.InterpreterShim._dummy_gm``, cached),
   lazily, in whichever thread first lowers a loop body.  ``symbolic_trace``
   also patches ``torch.nn.Module.__call__``/``__getattr__`` and ``math``
   functions process-wide for its duration, so another thread calling a module
   meanwhile fails ("module is not installed as a submodule") and other
   threads' guards fail.  We run that trace at install time, before workers.
   Limitation (every torch, 2.14+ too): user/library ``fx.symbolic_trace`` in
   one thread while other threads run modules or compile is unsafe for that
   reason; no worker may ``symbolic_trace`` while others run.  (make_fx is
   fine: it autowraps nothing and its module wrapper just calls through.)
2. ``block_mask_lock`` (2.13+, harmless elsewhere).  Eager ``create_block_mask``
   runs ``torch.fx.traceback.annotate({"fallback_to_eager": True})``, which
   mutates the global ``torch.fx.traceback.current_meta`` that another thread's
   compile is reading and rebinding: ``KeyError: 'custom'`` in either thread, or
   the marker leaks into the other thread's graph (inductor then falls back to
   eager for those nodes: ``LoweringException`` for flex, or silently slow).
   ``build_block_mask`` holds dynamo's ``convert_frame.compile_lock`` (held by
   every dynamo frame compile and inductor backward compile) while building.
   Detection: ``fx.traceback.annotate`` exists and flex's mask helpers call it.
3. ``worker_thread_config`` (2.12+ per-thread, 2.11 global).  ``torch._dynamo.config``
   and ``torch._inductor.config`` assignments are ContextVar-backed from 2.12:
   a value set in the main thread is invisible in worker threads (new threads
   start with an empty context).  Detection: a probe thread sets a value and
   the main thread looks.  ``configure_worker_thread`` applies overrides inside
   the worker; where config is process-global it instead refuses conflicting
   values from different threads (the installed recompile limits included: a
   worker changing them would change them for every thread).  Inductor options
   that must also govern the lazily compiled backward (which on CUDA runs in the autograd device thread,
   not in the worker) belong in ``torch.compile(options=...)``.
   ``torch.compiler.set_stance`` is process-wide on every version: only the main
   thread should call it.
4. ``recompile_limit``.  Threads that miss the cache for the same shape at the
   same time each compile it (the second waits for the compile lock, then does
   not re-check the cache), and every copy counts towards
   ``recompile_limit`` (default 8) of that code object.  With K threads sharing
   one ``torch.compile(flex_attention)`` and S shape buckets up to S*K entries
   are needed; past the limit dynamo silently runs flex's unfused eager path.
   We raise the limit (default ``DEFAULT_RECOMPILE_LIMIT``; size it with
   ``recompile_limit_for``) in the installing thread, as the process-wide
   default where config is per-thread, and in every ``configure_worker_thread``.
5. ``cudagraph_tls`` (torch <= 2.12).  ``cudagraph_trees.get_obj`` asserts in a
   Python thread other than the importing one (its TLS was initialised only at
   import).  2.13 initialises it lazily; we backport that ``get_obj``.
   Detection: call ``get_obj`` in a fresh probe thread (which then stays parked
   until exit: a thread holding stashed TLS objects that exits during interpreter
   shutdown aborts the process).  2.13 also serialises
   graph capture across threads (``graph_capture_lock``); without that lock we
   *refuse* CUDA-graph trees in worker threads: see
   ``cudagraphs_allowed_in_threads``; ``configure_worker_thread`` raises if
   asked for ``triton.cudagraphs`` then.  ``mode="reduce-overhead"`` cannot be
   intercepted - check ``cudagraphs_allowed_in_threads()`` before using it.
6. ``compile_counter``.  Counts dynamo frame compiles and lazy backward
   compiles per worker thread (backward compiles are credited to the thread
   that compiled the forward, since on CUDA they run in autograd's device
   thread).  Hooked by wrapping ``torch._dynamo.callback_handler.install_callbacks``
   (entered once per compile, in the compiling thread, on 2.11-2.15); the
   public ``on_compile_start`` callbacks are not used because they fire only for
   the outermost of overlapping compiles across *all* threads.  Also counts
   recompile-limit hits (dynamo's silent eager fallback) per thread, from the
   warning dynamo logs in the thread that hit it.
   ``install_compile_safety(fixes=False)`` installs only this counter, to
   measure an unfixed run the same way.
7. ``cuda_guard_prime`` (CUDA builds of torch on a machine without a usable GPU,
   e.g. PyPI's default Linux wheel in CPU-only CI).  There ``FakeTensorMode.__enter__``
   - entered by every compile - calls ``torch._C._ensureCUDADeviceGuardSet()`` to
   swap in a no-op CUDA device guard; its first calls from several threads at
   once crash the process (SIGSEGV, seen on 2.11.0+cu130; calls after one
   completed call are safe).  We make that first call at install time.
   Detection: CUDA compiled but not available, and ``FakeTensorMode.__enter__``
   calls it.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import logging
import threading
import types
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "DEFAULT_RECOMPILE_LIMIT",
    "FixResult",
    "RecompileAfterWarmupError",
    "SafetyReport",
    "TESTED_TORCH",
    "build_block_mask",
    "check_threaded_compile_supported",
    "configure_worker_thread",
    "cudagraphs_allowed_in_threads",
    "install_compile_safety",
    "mark_warmup_done",
    "recompile_limit_for",
    "recompile_snapshot",
]

# 8 buckets x 4 threads sharing one compiled flex, x2 for grad-mode/guard variants.
DEFAULT_RECOMPILE_LIMIT = 64
# The torch releases whose internals the fixes were written against and tested on (the GPU
# machine runs 2.11, the CPU suite 2.13); pyproject.toml bounds torch to them.
TESTED_TORCH = "2.11 to 2.13"


def recompile_limit_for(num_shape_buckets: int, num_threads: int, *, slack: int = 8) -> int:
    """Recompile limit for one compiled function called with ``num_shape_buckets``
    static shapes from ``num_threads`` threads: each thread may compile each shape
    once (concurrent misses are not deduplicated), plus ``slack`` for other guard
    variants (grad mode, dtype, ...).  Never below dynamo's default of 8."""
    return max(8, num_shape_buckets * num_threads + slack)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class FixResult:
    name: str
    applied: bool
    reason: str
    # False when this torch's internals are not what the fix knows (a reader of a flag it did not
    # expect, a hook that moved): the race may be there, unfixed. See check_threaded_compile_supported.
    recognised: bool = True


def _unrecognised(name: str, reason: str) -> FixResult:
    return FixResult(name, False, reason, recognised=False)


@dataclass(frozen=True)
class SafetyReport:
    torch_version: str
    fixes: tuple[FixResult, ...]

    @property
    def applied(self) -> list[str]:
        return [f.name for f in self.fixes if f.applied]

    @property
    def skipped(self) -> list[str]:
        return [f.name for f in self.fixes if not f.applied]

    @property
    def unrecognised(self) -> list[FixResult]:
        """Fixes that could not tell whether this torch needs them (see FixResult.recognised)."""
        return [f for f in self.fixes if not f.recognised]

    def fix(self, name: str) -> FixResult:
        return next(f for f in self.fixes if f.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "torch": self.torch_version,
            "fixes": {f.name: {"applied": f.applied, "reason": f.reason, "recognised": f.recognised} for f in self.fixes},
        }

    def __str__(self) -> str:
        lines = [f"torch {self.torch_version}: applied {self.applied or 'nothing'}, skipped {self.skipped or 'nothing'}"]
        lines += [f"  [{'applied' if f.applied else 'skipped'}{'' if f.recognised else ', UNRECOGNISED'}] {f.name}: {f.reason}"
                  for f in self.fixes]
        return "\n".join(lines)


class RecompileAfterWarmupError(RuntimeError):
    """A thread marked warm (``mark_warmup_done(fail_on_recompile=True)``) compiled again."""


# --------------------------------------------------------------------------- 1. per-thread flags
#
# Both torch.fx._symbolic_trace._is_fx_tracing_flag and torch.compiler._is_compiling_flag
# are module-global bools.  A module global cannot be made thread-local in place, so:
#   * the module's class gets a property of that name -> attribute access from other
#     modules (``torch.fx._symbolic_trace._is_fx_tracing_flag = False``) hits a
#     threading.local stored in the module under ``tls_name``;
#   * the module's own functions (LOAD_GLOBAL/STORE_GLOBAL bypass the property) get
#     their ``__code__`` replaced in place by the bodies below, which keeps every
#     reference to them (captured by dynamo, imported by name, keys of dynamo's
#     constant-folding tables) valid.  The bodies run with *that* module's globals,
#     hence the names undefined here.
# Only applied when the module's functions using the flag are exactly the known ones.


class _FlagTLS(threading.local):
    flag: bool = False  # class attribute: the value in threads that never set it


def _thread_local_flag_module_class(flag: str, tls_name: str) -> type[types.ModuleType]:
    def get(module: types.ModuleType) -> bool:
        return vars(module)[tls_name].flag

    def set_(module: types.ModuleType, value: bool) -> None:
        vars(module)[tls_name].flag = bool(value)

    return type(f"_ThreadLocal{flag.title().replace('_', '')}Module", (types.ModuleType,), {flag: property(get, set_)})


_FX_FLAG, _FX_TLS = "_is_fx_tracing_flag", "_dflash_fx_tracing_tls"
_COMPILING_FLAG, _COMPILING_TLS = "_is_compiling_flag", "_dflash_is_compiling_tls"


def _tls_is_fx_tracing() -> bool:
    is_fx_tracing_warning()  # type: ignore[name-defined]  # noqa: F821
    return _dflash_fx_tracing_tls.flag  # type: ignore[name-defined]  # noqa: F821


def _tls_is_fx_tracing_no_warning() -> bool:
    return _dflash_fx_tracing_tls.flag  # type: ignore[name-defined]  # noqa: F821


def _tls_is_fx_symbolic_tracing() -> bool:
    return _dflash_fx_tracing_tls.flag and not torch.compiler.is_compiling()  # type: ignore[name-defined]  # noqa: F821


def _tls_is_compiling() -> bool:
    if torch.jit.is_scripting():
        return False
    else:
        return _dflash_is_compiling_tls.flag  # type: ignore[name-defined]  # noqa: F821


def _tls_compile_session_context() -> Iterator[None]:
    old = _dflash_is_compiling_tls.flag  # type: ignore[name-defined]  # noqa: F821
    try:
        _dflash_is_compiling_tls.flag = True  # type: ignore[name-defined]  # noqa: F821
        yield
    finally:
        _dflash_is_compiling_tls.flag = old  # type: ignore[name-defined]  # noqa: F821


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _functions_of(module: types.ModuleType) -> Iterator[tuple[str, types.FunctionType]]:
    def unwrap(obj: Any) -> Any:
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        try:
            return inspect.unwrap(obj) if callable(obj) else obj
        except ValueError:  # __wrapped__ cycle
            return obj

    for name, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            for attr, member in vars(value).items():
                parts = [member.fget, member.fset] if isinstance(member, property) else [member]
                for part in parts:
                    fn = unwrap(part)
                    if isinstance(fn, types.FunctionType):
                        yield f"{name}.{attr}", fn
        else:
            fn = unwrap(value)
            if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
                yield name, fn


def _global_users(module: types.ModuleType, name: str) -> dict[str, set[str]]:
    """{qualified function name: {"LOAD_GLOBAL", "STORE_GLOBAL"}} for global ``name``."""
    users: dict[str, set[str]] = {}
    for qualname, fn in _functions_of(module):
        ops = {
            ins.opname
            for code in _code_objects(fn.__code__)
            if name in code.co_names
            for ins in dis.get_instructions(code)
            if ins.argval == name and "GLOBAL" in ins.opname
        }
        if ops:
            users[qualname] = ops
    return users


def _function_at(module: types.ModuleType, qualname: str) -> types.FunctionType:
    obj: Any = module
    for part in qualname.split("."):
        obj = vars(obj)[part]
    return inspect.unwrap(obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj)


def _shape(code: types.CodeType) -> tuple[int, int]:
    kinds = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    return code.co_argcount + code.co_kwonlyargcount, code.co_flags & kinds


def _make_flag_thread_local(
    module: types.ModuleType,
    flag: str,
    tls_name: str,
    replacements: Mapping[str, Callable[..., Any]],
    known_users: Mapping[str, set[str]],
) -> tuple[_FlagTLS | None, str]:
    """Make ``module.<flag>`` per-thread (see the comment above).  Returns the
    thread-local, or None and why not."""
    namespace = vars(module)
    if tls_name in namespace:
        return namespace[tls_name], "already installed"
    if flag not in namespace:
        return None, f"{module.__name__} has no {flag}"
    if type(namespace[flag]) is not bool:
        return None, f"{module.__name__}.{flag} is a {type(namespace[flag]).__name__}, not a plain bool global"
    if type(module) is not types.ModuleType:
        return None, f"{module.__name__} already has a custom module class {type(module).__name__}"
    users = _global_users(module, flag)
    if users.keys() != known_users.keys() or any(not ops <= known_users[n] for n, ops in users.items()):
        return None, f"unexpected users of {module.__name__}.{flag}: {users}"
    for qualname, replacement in replacements.items():
        code = _function_at(module, qualname).__code__
        expected = (set(replacement.__code__.co_names) - {tls_name, "flag"}) | {flag}
        if set(code.co_names) != expected or code.co_freevars or _shape(code) != _shape(replacement.__code__):
            return None, f"{module.__name__}.{qualname} is not the known flag accessor (names {code.co_names})"

    tls = _FlagTLS()
    namespace[tls_name] = tls
    for qualname, replacement in replacements.items():
        _function_at(module, qualname).__code__ = replacement.__code__
    module.__class__ = _thread_local_flag_module_class(flag, tls_name)
    return tls, "installed"


def _check_flag_is_per_thread(read: Callable[[], bool], set_in_thread: Callable[[bool], None]) -> None:
    seen_in_other_thread: list[bool] = []

    def probe() -> None:
        set_in_thread(True)
        try:
            seen_in_other_thread.append(read())
        finally:
            set_in_thread(False)

    _run_in_thread(probe)
    if seen_in_other_thread != [True] or read():
        raise RuntimeError(f"thread-local flag self-check failed: {seen_in_other_thread}, here {read()}")


def _install_fx_flag_fix() -> FixResult:
    name = "fx_tracing_flag"
    import torch.fx._symbolic_trace as st

    if _FX_FLAG not in vars(st) and _FX_TLS not in vars(st):
        upstream = [n for n in vars(st) if "tracing" in n and ("tls" in n or "local" in n)]
        return FixResult(name, False, f"not needed: {st.__name__} has no {_FX_FLAG} (upstream keeps it thread-local: {upstream})")
    replacements = {
        "is_fx_tracing": _tls_is_fx_tracing if "is_fx_tracing_warning" in vars(st) else _tls_is_fx_tracing_no_warning,
        "is_fx_symbolic_tracing": _tls_is_fx_symbolic_tracing,
    }
    known_users = {
        "is_fx_tracing": {"LOAD_GLOBAL"},
        "is_fx_symbolic_tracing": {"LOAD_GLOBAL"},
        "Tracer.trace": {"LOAD_GLOBAL", "STORE_GLOBAL"},
    }
    tls, outcome = _make_flag_thread_local(st, _FX_FLAG, _FX_TLS, replacements, known_users)
    if tls is None:
        return _unrecognised(name, f"unsupported: {outcome}")
    if outcome == "already installed":
        return FixResult(name, True, "already installed: the FX tracing flag is per-thread")

    # Tracer.trace's own writes go to the (now unread) module global; set ours around it.
    original_trace = st.Tracer.trace

    @functools.wraps(original_trace)
    def trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        previous = tls.flag
        tls.flag = True
        try:
            return original_trace(self, *args, **kwargs)
        finally:
            tls.flag = previous

    st.Tracer.trace = trace  # type: ignore[method-assign]
    _check_flag_is_per_thread(st.is_fx_symbolic_tracing, lambda value: setattr(st, _FX_FLAG, value))
    return FixResult(
        name,
        True,
        f"{_FX_FLAG} was a process-global bool set by every FX trace (incl. AOTAutograd's make_fx in a compiling thread); "
        "now thread-local (is_fx_tracing, is_fx_symbolic_tracing, Tracer.trace, module attribute)",
    )


def _fx_flag_is_per_thread() -> bool:
    import torch.fx._symbolic_trace as st

    return _FX_TLS in vars(st) or _FX_FLAG not in vars(st)


def _install_is_compiling_fix() -> FixResult:
    name = "is_compiling_flag"
    from torch import compiler

    namespace = vars(compiler)
    if _COMPILING_TLS in namespace:
        return FixResult(name, True, "already installed: torch.compiler.is_compiling() is per-thread")
    session = namespace.get("_compile_session_context")
    if session is None or "STORE_GLOBAL" not in _global_users(compiler, _COMPILING_FLAG).get("_compile_session_context", set()):
        return FixResult(name, False, "not needed: dynamo compiles do not set torch.compiler._is_compiling_flag (only export)")
    if not _fx_flag_is_per_thread():
        # The global is_compiling() is what hides the global FX flag during other threads' compiles.
        return _unrecognised(name, "skipped: the FX tracing flag is process-global, and a global is_compiling() hides it")
    replacements = {"is_compiling": _tls_is_compiling, "_compile_session_context": _tls_compile_session_context}
    known_users = {"is_compiling": {"LOAD_GLOBAL"}, "_compile_session_context": {"LOAD_GLOBAL", "STORE_GLOBAL"}}
    tls, outcome = _make_flag_thread_local(compiler, _COMPILING_FLAG, _COMPILING_TLS, replacements, known_users)
    if tls is None:
        return _unrecognised(name, f"unsupported: {outcome}")
    _check_flag_is_per_thread(compiler.is_compiling, lambda value: setattr(compiler, _COMPILING_FLAG, value))
    return FixResult(
        name,
        True,
        "torch.compiler.is_compiling() read a process-global that any thread's dynamo compile sets: eager code in other "
        "threads (transformers' is_torchdynamo_compiling, flex helpers) took compile-only branches; now per-thread",
    )


def _prime_cuda_device_guard() -> FixResult:
    name = "cuda_guard_prime"
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is None:
        return FixResult(name, False, "not needed: torch._C has no _ensureCUDADeviceGuardSet")
    if not torch.cuda._is_compiled():
        return FixResult(name, False, "not needed: a CPU build of torch (no CUDA device guard to swap)")
    if torch.cuda.is_available():
        return FixResult(name, False, "not needed: CUDA is available, so compiles do not swap the CUDA device guard")
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as error:
        return _unrecognised(name, f"not recognised: no FakeTensorMode ({error})")
    if "_ensureCUDADeviceGuardSet" not in _source_or_empty(FakeTensorMode.__enter__):
        return FixResult(name, False, "not needed: FakeTensorMode.__enter__ does not call _ensureCUDADeviceGuardSet")
    ensure()
    return FixResult(
        name,
        True,
        "CUDA build without a usable GPU: every compile's FakeTensorMode.__enter__ calls "
        "torch._C._ensureCUDADeviceGuardSet(), whose first concurrent calls crash the process (SIGSEGV); "
        "called once now in the installing thread",
    )


def _prime_inductor_fx_trace() -> FixResult:
    name = "inductor_fx_trace"
    try:
        from torch._inductor.loop_body import InterpreterShim
    except Exception as error:  # noqa: BLE001
        return _unrecognised(name, f"not recognised: no inductor loop_body.InterpreterShim ({error!r})")
    dummy_gm = getattr(InterpreterShim, "_dummy_gm", None)
    if not (callable(dummy_gm) and hasattr(dummy_gm, "cache_info")):
        return _unrecognised(name, "not recognised: inductor has no cached _dummy_gm symbolic trace")
    already = dummy_gm.cache_info().currsize > 0
    dummy_gm()
    return FixResult(
        name,
        True,
        "inductor's one-off FX symbolic trace (loop_body InterpreterShim._dummy_gm) "
        + ("was already done" if already else "done now in the installing thread, not lazily inside a worker's compile"),
    )


# --------------------------------------------------------------------------- 2. block masks

_FALLBACK_MASK_LOCK = threading.RLock()


def _dynamo_compile_lock() -> Any | None:
    try:
        from torch._dynamo import convert_frame
    except ImportError:
        return None
    lock = getattr(convert_frame, "compile_lock", None)
    if all(hasattr(lock, attr) for attr in ("acquire", "release", "__enter__", "__exit__")):
        return lock
    return None


def mask_build_lock() -> Any:
    """The lock to hold around eager BlockMask construction (``create_block_mask``,
    ``BlockMask.from_kv_blocks``, ``_adjust``): dynamo's compile lock when torch
    has one, else a lock of ours (which then only serialises mask builders)."""
    return _dynamo_compile_lock() or _FALLBACK_MASK_LOCK


def build_block_mask(
    mask_mod: Callable[..., torch.Tensor],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    **kwargs: Any,
) -> BlockMask:
    """``create_block_mask`` under ``mask_build_lock()``, so the FX metadata it
    writes while building cannot reach another thread's compile (fix 2)."""
    from torch.nn.attention.flex_attention import create_block_mask

    with mask_build_lock():
        return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE, **kwargs)


def _check_mask_race() -> FixResult:
    name = "block_mask_lock"
    lock = _dynamo_compile_lock()
    try:
        import torch.fx.traceback as fx_traceback
        from torch.nn.attention import flex_attention as flex
    except ImportError as error:
        return _unrecognised(name, f"flex_attention unavailable: {error}")
    annotating = [
        helper
        for helper in ("_dense_to_ordered", "_transpose_ordered", "create_block_mask")
        if "annotate" in _source_or_empty(getattr(flex, helper, None))
    ]
    writes_global_meta = isinstance(getattr(fx_traceback, "current_meta", None), dict) and hasattr(fx_traceback, "annotate")
    if lock is not None:
        lock_name = "torch._dynamo.convert_frame.compile_lock"
    else:
        lock_name = "a private lock (no dynamo compile lock found: masks are only serialised among themselves)"
    if annotating and writes_global_meta:
        why = f"flex {', '.join(annotating)} call fx.traceback.annotate, which writes the global fx.traceback.current_meta"
        return FixResult(name, lock is not None, f"{why}; build_block_mask holds {lock_name}", recognised=lock is not None)
    return FixResult(name, False, f"not needed (mask building writes no global FX metadata); build_block_mask holds {lock_name}")


def _source_or_empty(obj: Any) -> str:
    try:
        return inspect.getsource(obj) if obj is not None else ""
    except (OSError, TypeError):
        return ""


# --------------------------------------------------------------------------- 3./4. config


@dataclass
class _ConfigPolicy:
    thread_local: bool
    defaults: dict[str, dict[str, Any]]  # {"dynamo": {...}, "inductor": {...}} applied in every worker


_POLICY: _ConfigPolicy | None = None
_GLOBAL_CLAIMS: dict[tuple[str, str], tuple[Any, str]] = {}
_GLOBAL_CLAIMS_LOCK = threading.Lock()


def _config_modules() -> dict[str, Any]:
    import torch._dynamo.config
    import torch._inductor.config

    return {"dynamo": torch._dynamo.config, "inductor": torch._inductor.config}


def _config_is_thread_local() -> bool:
    """Behavioural probe: does a value set in another thread stay there?"""
    config = torch._dynamo.config
    original = config.recompile_limit
    probe_value = original + 1000  # larger limit: harmless if it leaks for an instant
    value_set, value_read = threading.Event(), threading.Event()

    def probe() -> None:
        config.recompile_limit = probe_value
        value_set.set()
        value_read.wait()
        config.recompile_limit = original

    thread = threading.Thread(target=probe, name="dflash-config-probe", daemon=True)
    thread.start()
    value_set.wait()
    seen_here = config.recompile_limit
    value_read.set()
    thread.join()
    return seen_here != probe_value


def _install_config_policy(recompile_limit: int | None, fail_on_recompile_limit_hit: bool) -> list[FixResult]:
    global _POLICY
    thread_local = _config_is_thread_local()
    dynamo_defaults: dict[str, Any] = {}
    config = torch._dynamo.config
    if recompile_limit is not None:
        dynamo_defaults["recompile_limit"] = max(recompile_limit, config.recompile_limit)
        dynamo_defaults["accumulated_recompile_limit"] = max(config.accumulated_recompile_limit, 4 * recompile_limit)
    if fail_on_recompile_limit_hit:
        dynamo_defaults["fail_on_recompile_limit_hit"] = True
    _POLICY = _ConfigPolicy(thread_local=thread_local, defaults={"dynamo": dynamo_defaults, "inductor": {}})

    for key, value in dynamo_defaults.items():
        setattr(config, key, value)
    if not thread_local:
        # The installed values are already every thread's: a worker asking for another
        # one would change them for all threads, so it conflicts with the installer.
        owner = f"install_compile_safety() in {threading.current_thread().name}"
        with _GLOBAL_CLAIMS_LOCK:
            for key, value in dynamo_defaults.items():
                _GLOBAL_CLAIMS[("dynamo", key)] = (value, owner)
    process_default_note = ""
    if thread_local:
        # Threads that never call configure_worker_thread (target worker, autograd
        # threads, library threads) still get the raised limit.
        raised = []
        for key, value in dynamo_defaults.items():
            entry = getattr(config, "_config", {}).get(key)
            if entry is not None and hasattr(entry, "default"):
                entry.default = value
                raised.append(key)
        process_default_note = f"; also made the process-wide default for {raised}" if raised else ""

    results = [
        FixResult(
            "worker_thread_config",
            thread_local,
            "dynamo/inductor config is per-thread (ContextVar): configure_worker_thread() applies it inside each worker"
            if thread_local
            else "config is process-global here: configure_worker_thread() sets it, rejecting conflicting values across threads",
        )
    ]
    if recompile_limit is None:
        results.append(FixResult("recompile_limit", False, f"left at {config.recompile_limit} (recompile_limit=None)"))
    else:
        results.append(
            FixResult(
                "recompile_limit",
                True,
                f"recompile_limit={dynamo_defaults['recompile_limit']}, "
                f"accumulated_recompile_limit={dynamo_defaults['accumulated_recompile_limit']}"
                f"{', fail_on_recompile_limit_hit=True' if fail_on_recompile_limit_hit else ''}: threads missing the same shape "
                f"concurrently each compile it and each copy counts{process_default_note}",
            )
        )
    return results


def configure_worker_thread(
    *,
    dynamo: Mapping[str, Any] | None = None,
    inductor: Mapping[str, Any] | None = None,
) -> None:
    """Apply dynamo/inductor config in the calling thread: the install-time defaults
    (recompile limits) first, then ``dynamo``/``inductor`` (flat keys, e.g.
    ``{"triton.cudagraphs": False}``).  Call at the start of every worker thread.

    Where config is process-global, two threads setting different values for the
    same key is an error instead of a silent last-writer-wins.  Enabling
    ``triton.cudagraphs`` raises if ``cudagraphs_allowed_in_threads()`` says no.
    """
    if _POLICY is None:
        raise RuntimeError("call install_compile_safety() in the main thread before configure_worker_thread()")
    overrides = {
        "dynamo": {**_POLICY.defaults["dynamo"], **(dynamo or {})},
        "inductor": {**_POLICY.defaults["inductor"], **(inductor or {})},
    }
    if overrides["inductor"].get("triton.cudagraphs"):
        allowed, reason = cudagraphs_allowed_in_threads()
        if not allowed:
            raise RuntimeError(f"CUDA-graph trees requested in worker thread {threading.current_thread().name!r}: {reason}")
    modules = _config_modules()
    thread_name = threading.current_thread().name
    for module_key, values in overrides.items():
        module = modules[module_key]
        for key, value in values.items():
            if not _POLICY.thread_local:
                with _GLOBAL_CLAIMS_LOCK:
                    claim = _GLOBAL_CLAIMS.setdefault((module_key, key), (value, thread_name))
                if claim[0] != value:
                    raise ValueError(
                        f"{module.__name__}.{key}: thread {thread_name!r} wants {value!r} but thread {claim[1]!r} "
                        f"set {claim[0]!r}, "
                        "and config is process-global on this torch"
                    )
            setattr(module, key, value)
    _ACCOUNTING.current()  # registers the thread, so it shows in recompile_snapshot() with 0 compiles


# --------------------------------------------------------------------------- 5. CUDA graphs


_PARK_FOREVER = threading.Event()  # never set
_GET_OBJ_WORKS: set[Any] = set()  # get_obj functions that worked in a new thread


def _run_in_parked_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a fresh daemon thread that then waits until the process exits.
    For probes that stash Python objects in the thread's C++ TLS (cudagraph trees'
    get_obj does, via ``torch._C._stash_obj_in_tls``): a thread whose TLS holds them
    exits by re-taking the GIL in their destructors, and if the interpreter is shutting
    down meanwhile the process aborts ("terminate called without an active exception"
    or SIGSEGV; seen on 2.11 and 2.13 when a script exits right after the probe)."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        finally:
            done.set()
        _PARK_FOREVER.wait()

    threading.Thread(target=run, name="dflash-compile-safety-cudagraph-probe", daemon=True).start()
    done.wait()


def _cudagraph_get_obj_works_in_new_thread(cgt: types.ModuleType) -> tuple[bool, str]:
    get_obj = cgt.get_obj
    if get_obj in _GET_OBJ_WORKS:  # a probe thread per call would pile up parked threads
        return True, ""
    outcome: list[str] = []

    def probe() -> None:
        try:
            get_obj(cgt.local, "tree_manager_containers")
            outcome.append("")
        except Exception as error:  # noqa: BLE001 - AssertionError on <=2.12, RuntimeError under python -O
            outcome.append(f"{type(error).__name__}: {error}")

    _run_in_parked_thread(probe)
    if outcome == [""]:
        _GET_OBJ_WORKS.add(get_obj)
    return outcome == [""], outcome[0] if outcome else "probe thread died"


def _lazy_tls_get_obj(cgt: types.ModuleType) -> Callable[[Any, str], Any]:
    """2.13's get_obj: initialise this thread's cudagraph-tree TLS on first use."""

    def initialize(local: threading.local) -> None:
        if hasattr(cgt, "_initialize_tls"):
            cgt._initialize_tls(local)
            return
        local.tree_manager_containers = {}
        local.tree_manager_locks = defaultdict(threading.Lock)
        # Stashed in C++ TLS so autograd's device threads inherit this thread's trees.
        torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
        torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)

    def get_obj(local: Any, attr_name: str) -> Any:
        if hasattr(local, attr_name):
            return getattr(local, attr_name)
        if not torch._C._is_key_in_tls(attr_name):
            initialize(local)
            return getattr(local, attr_name)
        return torch._C._get_obj_in_tls(attr_name)

    get_obj._dflash_backport = True  # type: ignore[attr-defined]
    return get_obj


def _install_cudagraph_tls_fix() -> FixResult:
    name = "cudagraph_tls"
    try:
        import torch._inductor.cudagraph_trees as cgt
    except Exception as error:  # noqa: BLE001
        return _unrecognised(name, f"cudagraph_trees not importable: {error!r}")
    if getattr(cgt.get_obj, "_dflash_backport", False):
        return FixResult(name, True, "already installed: get_obj initialises cudagraph-tree TLS lazily per thread")
    works, why = _cudagraph_get_obj_works_in_new_thread(cgt)
    if works:
        return FixResult(name, False, "not needed: cudagraph_trees.get_obj already works in new threads")
    if not (hasattr(cgt, "local") and hasattr(torch._C, "_stash_obj_in_tls") and hasattr(torch._C, "_is_key_in_tls")):
        return _unrecognised(name, f"unsupported: get_obj fails in new threads ({why}) and the TLS hooks are missing")
    cgt.get_obj = _lazy_tls_get_obj(cgt)  # type: ignore[assignment]
    works, after = _cudagraph_get_obj_works_in_new_thread(cgt)
    if not works:
        raise RuntimeError(f"cudagraph TLS backport self-check failed: {after}")
    return FixResult(name, True, f"get_obj failed in new threads ({why}); backported lazy per-thread TLS init")


def cudagraphs_allowed_in_threads() -> tuple[bool, str]:
    """Whether CUDA-graph trees (``mode="reduce-overhead"``, ``triton.cudagraphs``)
    may be used from worker threads with this torch (after ``install_compile_safety``)."""
    try:
        import torch._inductor.cudagraph_trees as cgt
    except Exception as error:  # noqa: BLE001
        return False, f"cudagraph_trees not importable: {error!r}"
    works, why = _cudagraph_get_obj_works_in_new_thread(cgt)
    if not works:
        return False, f"cudagraph-tree state is not initialised in new threads ({why}); run install_compile_safety() first"
    if not hasattr(cgt, "graph_capture_lock"):
        return False, (
            "this torch does not serialise CUDA-graph capture across Python threads (no cudagraph_trees.graph_capture_lock; "
            "upstream added it in 2.13): a synchronize or pool switch in one thread can invalidate another thread's capture. "
            "Use torch>=2.13 or leave CUDA graphs off in worker threads"
        )
    return True, "per-thread cudagraph-tree state and graph_capture_lock serialising captures across threads"


# --------------------------------------------------------------------------- 6. compile counter


@dataclass
class _ThreadCompileStats:
    name: str
    compiles: int = 0
    after_warmup: int = 0
    limit_hits: int = 0
    warm: bool = False
    fail_on_recompile: bool = False


class _CompileAccounting:
    _COUNTED_TRIGGERS = ("DYNAMO", "LAZY_BACKWARD")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._threads: list[_ThreadCompileStats] = []
        self._owner_by_compile_id: dict[str, _ThreadCompileStats] = {}
        self.fail_on_recompile_default = False

    def current(self) -> _ThreadCompileStats:
        stats = getattr(self._local, "stats", None)
        if stats is None:
            stats = _ThreadCompileStats(threading.current_thread().name)
            self._local.stats = stats
            with self._lock:
                self._threads.append(stats)
        return stats

    def on_compile(self, trigger: Any, compile_id: str) -> None:
        trigger_name = getattr(trigger, "name", str(trigger))
        if trigger_name not in self._COUNTED_TRIGGERS:
            return
        with self._lock:
            owner = self._owner_by_compile_id.get(compile_id) if trigger_name == "LAZY_BACKWARD" else None
        stats = owner or self.current()
        with self._lock:
            if trigger_name == "DYNAMO":
                self._owner_by_compile_id[compile_id] = stats
            stats.compiles += 1
            if stats.warm:
                stats.after_warmup += 1
            fail = stats.warm and stats.fail_on_recompile
        if fail:
            raise RecompileAfterWarmupError(
                f"thread {stats.name!r} compiled after warm-up ({trigger_name}, compile id {compile_id}); "
                "a shape outside the warmed buckets or a guard failure - run with TORCH_LOGS=recompiles to see why"
            )

    def on_limit_hit(self) -> None:
        stats = self.current()
        with self._lock:
            stats.limit_hits += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        result: dict[str, dict[str, int]] = {}
        with self._lock:
            for stats in self._threads:
                key = stats.name
                suffix = 2
                while key in result:
                    key = f"{stats.name}#{suffix}"
                    suffix += 1
                result[key] = {"compiles": stats.compiles, "after_warmup": stats.after_warmup, "limit_hits": stats.limit_hits}
        return result


_ACCOUNTING = _CompileAccounting()


class _RecompileLimitHitHandler(logging.Handler):
    """Dynamo logs this warning, in the hitting thread, instead of raising."""

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
            _ACCOUNTING.on_limit_hit()


_LIMIT_HIT_LOGGER = "torch._dynamo.convert_frame"


def _install_compile_counter(fail_on_recompile_after_warmup: bool) -> FixResult:
    name = "compile_counter"
    _ACCOUNTING.fail_on_recompile_default = fail_on_recompile_after_warmup
    try:
        from torch._dynamo import callback as dynamo_callback
    except ImportError as error:
        return _unrecognised(name, f"unsupported: no torch._dynamo.callback ({error})")
    handler = getattr(dynamo_callback, "callback_handler", None)
    original = getattr(handler, "install_callbacks", None)
    if getattr(original, "_dflash_compile_accounting", False):
        return FixResult(name, True, "already installed")
    limit_logger = logging.getLogger(_LIMIT_HIT_LOGGER)
    if not any(isinstance(h, _RecompileLimitHitHandler) for h in limit_logger.handlers):
        limit_logger.addHandler(_RecompileLimitHitHandler(level=logging.WARNING))
    if handler is not None and callable(original):

        @contextlib.contextmanager
        def install_callbacks(trigger: Any, compile_id: str) -> Iterator[None]:
            _ACCOUNTING.on_compile(trigger, compile_id)
            with original(trigger, compile_id):
                yield

        install_callbacks._dflash_compile_accounting = True  # type: ignore[attr-defined]
        handler.install_callbacks = install_callbacks  # instance attribute: seen by every call site
        return FixResult(name, True, "counting per thread via callback_handler.install_callbacks (DYNAMO + LAZY_BACKWARD)")
    register = getattr(dynamo_callback, "on_compile_start", None)
    if register is None:
        return _unrecognised(name, "unsupported: neither callback_handler.install_callbacks nor on_compile_start exists")
    register(lambda args: _ACCOUNTING.on_compile(args.callback_trigger, str(args.compile_id)))
    return FixResult(name, True, "degraded: on_compile_start fires only for the outermost of overlapping compiles across threads",
                     recognised=False)


def mark_warmup_done(fail_on_recompile: bool | None = None) -> None:
    """Mark the calling thread warm: later compiles count as ``after_warmup``,
    and raise ``RecompileAfterWarmupError`` if ``fail_on_recompile`` (default: the
    ``fail_on_recompile_after_warmup`` given to ``install_compile_safety``)."""
    stats = _ACCOUNTING.current()
    stats.fail_on_recompile = _ACCOUNTING.fail_on_recompile_default if fail_on_recompile is None else fail_on_recompile
    stats.warm = True


def recompile_snapshot() -> dict[str, dict[str, int]]:
    """``{thread_name: {"compiles": n, "after_warmup": m, "limit_hits": k}}`` for
    every thread that compiled or called ``configure_worker_thread``."""
    return _ACCOUNTING.snapshot()


# --------------------------------------------------------------------------- install

_INSTALL_LOCK = threading.Lock()
_LAST_REPORT: SafetyReport | None = None


def _run_in_thread(fn: Callable[[], None]) -> None:
    thread = threading.Thread(target=fn, name="dflash-compile-safety-probe", daemon=True)
    thread.start()
    thread.join()


def install_compile_safety(
    *,
    fixes: bool = True,
    recompile_limit: int | None = DEFAULT_RECOMPILE_LIMIT,
    fail_on_recompile_limit_hit: bool = False,
    fail_on_recompile_after_warmup: bool = False,
    verbose: bool = False,
) -> SafetyReport:
    """Install every fix this torch needs (see the module docstring); idempotent.

    Call in the main thread before worker threads start.  ``fixes=False``
    installs only the per-thread compile counter (to measure an unfixed run);
    a later call with ``fixes=True`` adds the rest.  ``recompile_limit``:
    see ``recompile_limit_for``; ``None`` leaves dynamo's limits alone.
    ``fail_on_recompile_limit_hit`` turns dynamo's silent eager fallback at the
    limit into an error.  ``fail_on_recompile_after_warmup`` is the default for
    ``mark_warmup_done``.  ``verbose`` prints the report.
    """
    with _INSTALL_LOCK:
        counter = _install_compile_counter(fail_on_recompile_after_warmup)
        if fixes:
            results = (
                _prime_cuda_device_guard(),
                _install_fx_flag_fix(),
                _install_is_compiling_fix(),
                _prime_inductor_fx_trace(),
                _check_mask_race(),
                *_install_config_policy(recompile_limit, fail_on_recompile_limit_hit),
                _install_cudagraph_tls_fix(),
                FixResult("cudagraphs_in_threads", *cudagraphs_allowed_in_threads()),
                counter,
            )
        else:
            results = (FixResult("fixes", False, "fixes=False: only the compile counter is installed"), counter)
        report = SafetyReport(torch.__version__, results)
        if fixes:
            global _LAST_REPORT
            _LAST_REPORT = report
    if verbose:
        print(report, flush=True)
    return report


def check_threaded_compile_supported(threads: int, report: SafetyReport | None = None) -> None:
    """Fail closed: refuse `threads` > 1 threads compiling at once on a torch whose internals a
    fix does not recognise (``SafetyReport.unrecognised``), since its race may then be there,
    unfixed. ``report``: that of ``install_compile_safety()`` (default: its latest call with
    fixes, installing them with the defaults if none was made yet). Raises ConfigError naming
    the torch version, what was not recognised and the ways out."""
    if threads <= 1:
        return
    if report is None:
        report = _LAST_REPORT or install_compile_safety()
    unknown = report.unrecognised
    if not unknown:
        return
    from ..errors import ConfigError

    what = "; ".join(f"{fix.name}: {fix.reason}" for fix in unknown)
    raise ConfigError(
        f"torch {report.torch_version}: the thread-safety fixes for torch.compile do not recognise this torch's "
        f"internals ({what}), so {threads} threads compiling at once are not known to be safe. Ways out: one drafter "
        f"thread (a single --drafter-devices entry), --compile off --attention sdpa (nothing compiled), or a tested "
        f"torch ({TESTED_TORCH}: pip install 'torch>=2.11,<2.14')"
    )
