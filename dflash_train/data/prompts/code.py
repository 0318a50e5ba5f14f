"""Coding prompts in the HumanEval eval format, taken from code that is not HumanEval.

The HumanEval benchmark asks "Complete the following Python function:" followed by a fenced
signature and docstring (see eval/benchmarks.py). A drafter learns that shape of answer from the
target's own completions of other functions in the same format:
  - `python-stdlib`: public functions and methods of public classes of the running interpreter's
    standard library (read with `ast`, never imported), whose docstring says what they do (at
    least 40 characters) and whose body does more than `pass`, `...` or `raise`. A method keeps
    its class line above it. The set depends on the Python version (about 4,400 with 3.11).
  - `python-packages`: the same rule over the source of the Python packages that dflash-train's
    own requirements install (torch and transformers and what they pull in: sympy, networkx,
    numpy, mpmath, jinja2, ...; `PACKAGE_SOURCES`), at most `MAX_PER_PACKAGE_FILE` functions of a
    file and `MAX_PER_PACKAGE` of a package (evenly spaced over its files), and one prompt per
    (function name, docstring), since transformers copies a method into dozens of model files.
    Without these the coding share of 100k prompts is 6 %; with them about 15 %.
  - `reasoning-gym`: the CodeI/O tasks shipped in the `reasoning-gym` package (data/codeio*.jsonl.gz,
    about 3,200 distinct tasks): the task description and its input/output specification become
    the docstring of the task's `main_solution` signature, after the module's imports. The code
    itself is never executed.
Prompts longer than `MAX_CODE_PROMPT_CHARS` are left out. Decontamination against HumanEval
itself happens where all prompt sources meet (data/prompts/registry.py).
"""

from __future__ import annotations

import ast
import copy
import gzip
import importlib.util
import json
import sysconfig
import warnings
from pathlib import Path
from typing import Iterator, Sequence

from ...assets import package_path
from ...processes import map_anywhere
from ..decontaminate import normalized_key
from ..readers import Prompt

CODEIO_FILES = ("data/codeio.jsonl.gz", "data/codeio-hq.jsonl.gz")
HUMANEVAL_HEADER = "Complete the following Python function:\n```python\n"
MAX_CODE_PROMPT_CHARS = 2000
MIN_DOCSTRING_CHARS = 40
# Installed with dflash-train's requirements on every machine (a missing one gives no prompts).
PACKAGE_SOURCES = ("sympy", "transformers", "torch", "networkx", "numpy", "mpmath", "jinja2", "huggingface_hub",
                   "fsspec", "setuptools", "packaging", "tqdm")
MAX_PER_PACKAGE = 3000
MAX_PER_PACKAGE_FILE = 20
# Folders that hold tests, demos, bundled wheels, third-party or vendored code.
_SKIPPED_DIRS = {"test", "tests", "testing", "idle_test", "idlelib", "turtledemo", "site-packages", "dist-packages",
                 "ensurepip", "lib2to3", "_vendor", "vendor", "benchmarks"}


def humaneval_style_prompt(code: str) -> str:
    return f"{HUMANEVAL_HEADER}{code.rstrip()}\n```"


def _stub(function: ast.FunctionDef | ast.AsyncFunctionDef, docstring: ast.stmt) -> ast.FunctionDef | ast.AsyncFunctionDef:
    stub = copy.copy(function)
    stub.body = [docstring]
    return stub


def _does_work(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """More than a docstring and a placeholder (`pass`, `...`, `raise ...`), and not abstract."""
    body = function.body[1:]
    if any(isinstance(d, ast.Name) and d.id == "abstractmethod" or isinstance(d, ast.Attribute) and d.attr == "abstractmethod"
           for d in function.decorator_list):
        return False
    placeholder = (ast.Pass, ast.Raise)
    return any(not (isinstance(s, placeholder) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in body)


def _documented(function: ast.AST) -> bool:
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or function.name.startswith("_"):
        return False
    docstring = ast.get_docstring(function)
    return docstring is not None and len(docstring) >= MIN_DOCSTRING_CHARS and _does_work(function)


def _module_stubs(tree: ast.Module) -> Iterator[tuple[str, int, str, str]]:
    """(qualified name, line, code, docstring) of each documented public function and method; of
    two with one name (a property and its setter, a function defined per platform) the first."""
    named: set[str] = set()
    for node in tree.body:
        if _documented(node) and node.name not in named:
            named.add(node.name)
            yield node.name, node.lineno, ast.unparse(_stub(node, node.body[0])), ast.get_docstring(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for method in node.body:
                name = f"{node.name}.{method.name}" if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) else ""
                if _documented(method) and name not in named:
                    named.add(name)
                    holder = copy.copy(node)
                    holder.body, holder.decorator_list = [_stub(method, method.body[0])], []
                    yield name, method.lineno, ast.unparse(holder), ast.get_docstring(method)


def _public_sources(root: Path) -> list[Path]:
    """Each public module under `root` (sorted), without tests, demos and vendored code."""
    return [path for path in sorted(root.rglob("*.py"))
            if not any(part in _SKIPPED_DIRS or part.startswith(("_", "."))
                       for part in path.relative_to(root).parts)]


def _file_stubs(path: Path) -> list[tuple[str, int, str, str]]:
    """`_module_stubs` of one file (none if it does not parse: a template or a file for another
    Python version). A worker's job (dflash_train/processes.py): it depends on the file alone."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []
    return list(_module_stubs(tree))


def _source_stubs(roots: Sequence[Path], workers: int | None) -> list[list[tuple[Path, list[tuple[str, int, str, str]]]]]:
    """Per root: (path relative to it, its stubs) of each public module, in path order; every
    root's files parsed in one map over worker processes."""
    paths = [_public_sources(root) for root in roots]
    stubs = iter(map_anywhere(_file_stubs, [path for files in paths for path in files], workers,
                              what="parsing Python sources for coding prompts"))
    return [[(path.relative_to(root), next(stubs)) for path in files] for root, files in zip(roots, paths)]


def _function_prompt(where: str, name: str, line: int, code: str) -> Prompt | None:
    text = humaneval_style_prompt(code)
    if len(text) > MAX_CODE_PROMPT_CHARS:
        return None
    return Prompt(f"{where}:{name}", [{"role": "user", "content": text}], f"{where}:{line}")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_prompts(root: str | Path | None = None, workers: int | None = None) -> list[Prompt]:
    """HumanEval-format prompts from the standard library's documented functions, in file order."""
    root = Path(root) if root is not None else stdlib_root()
    prompts = []
    for relative, stubs in _source_stubs([root], workers)[0]:
        for name, line, code, _ in stubs:
            prompt = _function_prompt(f"python-stdlib/{relative.as_posix()}", name, line, code)
            if prompt is not None:
                prompts.append(prompt)
    return prompts


def package_root(package: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it (None if absent)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _evenly_spaced(items: list, count: int) -> list:
    if len(items) <= count:
        return items
    return [items[(k * len(items)) // count] for k in range(count)]


def package_prompts(packages: Sequence[str] = PACKAGE_SOURCES, *, roots: dict[str, Path] | None = None,
                    max_per_package: int = MAX_PER_PACKAGE, max_per_file: int = MAX_PER_PACKAGE_FILE,
                    workers: int | None = None) -> list[Prompt]:
    """HumanEval-format prompts from installed packages' documented functions (see the module doc).

    `roots` (package -> folder) replaces the installed packages' folders (tests)."""
    found = [(package, roots[package] if roots is not None else package_root(package)) for package in packages]
    found = [(package, root) for package, root in found if root is not None]
    prompts, seen = [], set()
    for (package, _), files in zip(found, _source_stubs([root for _, root in found], workers)):
        taken = []
        for relative, stubs in files:
            in_file = 0
            for name, line, code, docstring in stubs:
                key = normalized_key(f"{name.rsplit('.', 1)[-1]}\0{docstring}")
                prompt = None if key in seen else _function_prompt(f"python-packages/{package}/{relative.as_posix()}",
                                                                   name, line, code)
                if prompt is None:
                    continue
                seen.add(key)
                taken.append(prompt)
                in_file += 1
                if in_file == max_per_file:
                    break
        prompts += _evenly_spaced(taken, max_per_package)
    return prompts


def _codeio_rows(path: Path) -> list[dict]:
    text = gzip.decompress(path.read_bytes()).decode("utf-8")
    # codeio-hq.jsonl.gz holds one JSON array despite its name; codeio.jsonl.gz is JSON lines.
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _indented_docstring(text: str) -> ast.Expr:
    lines = text.strip().splitlines()
    body = "\n".join([lines[0]] + [f"    {line}" if line.strip() else "" for line in lines[1:]])
    return ast.Expr(ast.Constant(f"{body}\n    "))


def codeio_prompt(row: dict) -> str | None:
    """The HumanEval-format prompt of one CodeI/O task, or None if its code has no `main_solution`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in some samples' strings
            tree = ast.parse(row["code_sample"])
        description = f"{row['task_description'].strip()}\n\n{row['input_output_spec'].strip()}"
    except (SyntaxError, ValueError, KeyError, TypeError, AttributeError):
        return None
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main_solution"), None)
    if main is None:
        return None
    stub = ast.unparse(_stub(main, _indented_docstring(description)))
    return humaneval_style_prompt("\n".join(imports) + "\n\n\n" + stub if imports else stub)


def codeio_prompts() -> list[Prompt]:
    """HumanEval-format prompts from reasoning-gym's CodeI/O tasks, one per distinct task description."""
    prompts, seen = [], set()
    for relative in CODEIO_FILES:
        path = package_path("reasoning_gym", relative, "reasoning-gym")
        for number, row in enumerate(_codeio_rows(path), start=1):
            if not isinstance(row, dict) or not isinstance(row.get("task_description"), str):
                continue
            key = normalized_key(row["task_description"])
            text = codeio_prompt(row) if key not in seen else None
            if text is None or len(text) > MAX_CODE_PROMPT_CHARS:
                continue
            seen.add(key)
            where = f"reasoning-gym/{Path(relative).name}:{number}"
            prompts.append(Prompt(where, [{"role": "user", "content": text}], where))
    return prompts
