"""HumanEval-format coding prompts from the standard library's source and reasoning-gym's CodeI/O tasks."""

import ast
import gzip
import json
import textwrap

import pytest

from dflash_train.assets import MissingAsset, package_path
from dflash_train.data.code_prompts import (
    CODEIO_FILES,
    HUMANEVAL_HEADER,
    REASONING_GYM_INSTALL,
    codeio_prompt,
    stdlib_prompts,
)

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


def test_a_real_codeio_task_becomes_a_main_solution_stub():
    try:
        path = package_path("reasoning_gym", CODEIO_FILES[0], REASONING_GYM_INSTALL)
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
