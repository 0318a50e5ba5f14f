"""HumanEval-format coding prompts from the standard library's source and reasoning-gym's CodeI/O tasks."""

import ast
import gzip
import json
import textwrap

import pytest
from dflash_train.data.prompts.code import (
    CODEIO_FILES,
    HUMANEVAL_HEADER,
    codeio_prompt,
    package_prompts,
    package_root,
    stdlib_prompts,
)

from dflash_train.assets import MissingAsset, package_path

MODULE = '''
import os


def documented(path, mode="r"):
    """Open the file at `path` and return its lines, without the trailing newlines."""
    with open(path, mode) as handle:
        return handle.read().splitlines()


def _private(x):
    """A private helper that is documented well enough to be taken otherwise."""
    return x


def short_doc(x):
    """Too short."""
    return x


def placeholder(x):
    """Only a placeholder body follows this long enough docstring here."""
    raise NotImplementedError


class Shelf(object):
    """A class."""

    def count_books(self, author=None):
        """Count the books on the shelf, only those by `author` when one is given."""
        return sum(1 for b in self.books if author in (None, b.author))

    @abc.abstractmethod
    def reorder(self):
        """Abstract methods are skipped: subclasses define what they do."""
        return None
'''


def code_of(prompt):
    return code_of_text(prompt.messages[0]["content"])


def code_of_text(text):
    assert text.startswith(HUMANEVAL_HEADER) and text.endswith("\n```")
    return text[len(HUMANEVAL_HEADER):-4]


def test_stdlib_prompts_take_documented_public_functions_with_a_body(tmp_path):
    (tmp_path / "shelves.py").write_text(MODULE)
    (tmp_path / "_hidden.py").write_text(MODULE)  # private module
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_shelves.py").write_text(MODULE)  # the stdlib's tests
    (tmp_path / "broken.py").write_text("def (:\n")
    prompts = stdlib_prompts(tmp_path)
    assert [p.id for p in prompts] == ["python-stdlib/shelves.py:documented", "python-stdlib/shelves.py:Shelf.count_books"]
    assert prompts[0].source == "python-stdlib/shelves.py:5"
    function, method = (code_of(p) for p in prompts)
    assert function == textwrap.dedent('''\
        def documented(path, mode='r'):
            """Open the file at `path` and return its lines, without the trailing newlines."""''')
    assert method.startswith("class Shelf(object):\n") and "def count_books(self, author=None):" in method
    for code in (function, method):  # the stub is valid Python whose function body is the docstring alone
        function_node = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef))
        assert len(function_node.body) == 1 and ast.get_docstring(function_node)


def _function(name: str, doc: str) -> str:
    return f'def {name}(x):\n    """{doc}"""\n    return x + 1\n\n\n'


def test_package_prompts_cap_files_and_packages_and_drop_copied_methods(tmp_path):
    """Two packages on disk: a file gives at most `max_per_file`, a package at most
    `max_per_package` spread over its files (not its first files), a function copied under the same
    name and docstring into another file (as transformers copies methods between models) is taken
    once, tests and vendored folders are skipped, and a package that is not there gives nothing."""
    alpha, beta = tmp_path / "alpha", tmp_path / "beta"
    for number in range(6):  # alpha/m0.py .. m5.py, 4 documented functions each
        (alpha / "models").mkdir(parents=True, exist_ok=True)
        (alpha / "models" / f"m{number}.py").write_text("".join(
            _function(f"f{number}_{k}", f"Return x plus one, the variant {number}.{k} of this long docstring.") for k in range(4)))
    (alpha / "tests").mkdir()
    (alpha / "tests" / "t.py").write_text(_function("tested", "A function inside the package's tests, never taken."))
    (alpha / "_vendor").mkdir()
    (alpha / "_vendor" / "v.py").write_text(_function("vendored", "A function of vendored code, never taken either."))
    copied = _function("forward", "Run the model forward over the input ids and return hidden states.")
    (beta / "llama").mkdir(parents=True)
    (beta / "llama" / "model.py").write_text(copied)
    # A property and its setter share a name: one prompt, so prompt ids stay unique.
    (beta / "llama" / "config.py").write_text(
        "class Config:\n    @property\n" + textwrap.indent(_function("size", "The number of hidden units of every layer here."), "    ")
        + "    @size.setter\n" + textwrap.indent(_function("size", "Set the number of hidden units of every layer."), "    "))
    (beta / "mistral").mkdir()
    (beta / "mistral" / "model.py").write_text(copied + _function("own", "A function only the mistral file has, taken."))
    roots = {"alpha": alpha, "beta": beta, "gamma": None}
    uncapped = [p.id for p in package_prompts(["alpha"], roots=roots, max_per_package=100, max_per_file=2)]
    assert uncapped == [f"python-packages/alpha/models/m{n}.py:f{n}_{k}" for n in range(6) for k in range(2)]
    prompts = package_prompts(["alpha", "beta", "gamma"], roots=roots, max_per_package=4, max_per_file=2)
    ids = [p.id for p in prompts]
    # 12 candidates, 4 kept at every third: from files 0, 1, 3 and 4, not the first two files.
    assert ids[:4] == [uncapped[k] for k in (0, 3, 6, 9)]
    assert ids[4:] == ["python-packages/beta/llama/config.py:Config.size", "python-packages/beta/llama/model.py:forward",
                       "python-packages/beta/mistral/model.py:own"]
    for prompt in prompts:  # each is valid Python with one function stub
        assert sum(isinstance(n, ast.FunctionDef) for n in ast.walk(ast.parse(code_of(prompt)))) == 1


def test_package_root_finds_an_installed_package_without_importing_it():
    root = package_root("sympy")
    assert root is not None and (root / "__init__.py").is_file()
    assert package_root("no_such_package_anywhere") is None


def test_a_real_codeio_task_becomes_a_main_solution_stub():
    try:
        path = package_path("reasoning_gym", CODEIO_FILES[0], "reasoning-gym")
    except MissingAsset as error:
        pytest.skip(str(error))
    row = json.loads(gzip.open(path, "rt").readline())
    code = code_of_text(codeio_prompt(row))
    tree = ast.parse(code)
    main = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert [n.name for n in main] == ["main_solution"] and len(main[0].body) == 1  # signature and docstring only
    docstring = ast.get_docstring(main[0])
    assert docstring.startswith(row["task_description"].strip()[:60]) and "Input:" in docstring
    assert [ast.unparse(n) for n in tree.body[:-1]] == ["import numpy as np"]  # the task's imports come first
    assert codeio_prompt({**row, "code_sample": "def helper():\n    pass\n"}) is None
