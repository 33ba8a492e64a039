"""No function in jaxrl4llm/ is longer than MAX_LINES lines: a long function is split into stages,
each a function of its own whose name says what it is, and the function that was long becomes a
short composition of them.

A function's length is counted from its `def` line (decorators excluded) to its last line, ast's
`end_lineno - lineno + 1`, docstring and comments included. Every `def` and `async def` counts,
methods and nested functions too (a nested function's lines count in its own length and in each
enclosing function's). The source is read with ast, nothing is imported.

ALLOWED is the one list of exceptions, as (path from the repository root, qualified name: `f`,
`Class.method`, `outer.inner`). An entry must still name a function over the limit: once that
function is split, test_allowed_functions_are_still_over_the_limit fails until the entry goes.
"""

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxrl4llm"
MAX_LINES = 120

# Empty: split a long function instead of adding an entry.
ALLOWED: set[tuple[str, str]] = set()


class Function(NamedTuple):
    """One `def` / `async def`: `path`:`line` (path from the package's parent, POSIX), its
    qualified name and its length in lines."""

    path: str
    line: int
    name: str
    lines: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} ({self.lines} lines)"


def functions(package: Path = PACKAGE) -> list[Function]:
    """Every function defined in the package's .py files, nested ones included, in file order."""
    found = []

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append(Function(path, child.lineno, name, child.end_lineno - child.lineno + 1))
                visit(child, path, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, path, prefix + child.name + ".")
            else:
                visit(child, path, prefix)  # functions inside if / try / with / for blocks

    for file in sorted(package.rglob("*.py")):
        path = file.relative_to(package.parent).as_posix()
        visit(ast.parse(file.read_text(encoding="utf-8"), filename=str(file)), path, "")
    return found


def long_functions(package: Path = PACKAGE, max_lines: int = MAX_LINES) -> list[Function]:
    """The functions of the package longer than max_lines."""
    return [f for f in functions(package) if f.lines > max_lines]


def test_no_function_is_longer_than_the_limit():
    long = [f for f in long_functions() if (f.path, f.name) not in ALLOWED]
    assert not long, (f"functions over {MAX_LINES} lines (split each into named stages, see this file's "
                      "docstring):\n" + "\n".join(map(str, long)))


def test_allowed_functions_are_still_over_the_limit():
    found = {(f.path, f.name): f for f in functions()}
    stale = [f"{path}: {name} " + ("is gone" if (path, name) not in found else f"has {found[path, name].lines} lines")
             for path, name in sorted(ALLOWED) if (path, name) not in found or found[path, name].lines <= MAX_LINES]
    assert not stale, (f"ALLOWED entries no longer over {MAX_LINES} lines; remove them from ALLOWED in "
                       "tests/test_function_length.py:\n" + "\n".join(stale))


def test_the_check_finds_long_functions_nested_async_and_methods(tmp_path):
    """The scan on a package made here: it names each function over the limit by file:line and
    qualified name, and none at the limit."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    body = lambda n, indent: "".join(f"{indent}x{i} = {i}\n" for i in range(n))
    (package / "__init__.py").write_text(
        "def short():\n" + body(9, "    ")  # lines 1-10: at the limit
        + "\n\ndef outer():\n    def inner():\n" + body(10, "        ")  # outer from line 13, inner 14-24
        + "    return inner\n")  # outer's last line, 25
    (package / "sub" / "mod.py").write_text(
        "import functools\n\n\nclass C:\n    @functools.cache\n    async def method(self):\n"  # from line 6
        + body(10, "        ") + "\n\nif True:\n    def in_a_block():\n" + body(10, "        "))  # from line 20
    found = [str(f) for f in long_functions(package, max_lines=10)]
    assert found == ["pkg/__init__.py:13: outer (13 lines)", "pkg/__init__.py:14: outer.inner (11 lines)",
                     "pkg/sub/mod.py:6: C.method (11 lines)", "pkg/sub/mod.py:20: in_a_block (11 lines)"]
