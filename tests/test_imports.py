"""The jaxrl4llm modules import each other down the package's layers (LAYERS) and without a cycle,
none uses another's private (`_x`) names, and they import each other at the top of the module
(LAZY_IMPORTS lists the exceptions and why).

The layers, bottom to top (a package is a subpackage or a top-level module of jaxrl4llm/;
`__init__` is jaxrl4llm/__init__.py):

    __init__ storage core kernels   the version, paths and filesystems, the loss math on arrays, the numerics kernels
    models                          the LLMs: weights, forward, decode step
    sampling data rewards tools     the rollout engine; datasets and prompts; the verifier; the tools a policy calls
    train                           the trainer
    plan study                      the planner and the studies, which read what train runs
    cli                             the command line

A module imports modules of its own package and of lower layers, never of a higher one. Above the
bottom, a package may import another of its own layer one way only: no two packages import each
other, directly or round a loop (data imports rewards; rewards imports no data). The bottom layer's
packages import none of each other: core is the pure loss math and kernels the numerics kernels,
neither needs the other (what core's log-probs take from kernels they take as an argument,
`core.token_logprobs_from_head(logprob_fn=...)`); storage stands alone, and jaxrl4llm/__init__.py,
which Python runs before any jaxrl4llm module, imports none. An import against the layers is fixed
by moving code: the imported piece down to the importer's layer or below, or the importing piece up;
an import moved into a function is no fix (the graph sees it).

The graph is read from the source (ast, nothing imported): an edge A -> B for every
`import B` / `from B import x` in A, at module level or inside a function, B a jaxrl4llm
module (`from P import m` is an edge to the module P.m when m is one, else to P's __init__).
A cycle means two modules each need the other: one of them holds a piece that belongs lower.
"""

import ast
from pathlib import Path
from typing import NamedTuple

PACKAGE = Path(__file__).resolve().parents[1] / "jaxrl4llm"

# Bottom to top; the module docstring gives the rule.
LAYERS = (
    ("__init__", "storage", "core", "kernels"),
    ("models",),
    ("sampling", "data", "rewards", "tools"),
    ("train",),
    ("plan", "study"),
    ("cli",),
)


def _module_names(package: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _known(name: str, modules) -> str | None:
    """The longest prefix of a dotted name that is a jaxrl4llm module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


class Import(NamedTuple):
    """One import statement's edge: `file`:`line` (module `importer`) imports module `imported`,
    taking `names` from it (`from M import a, b`; empty for `import M` and `from P import m`, m a module)."""

    file: str
    line: int
    importer: str
    imported: str
    names: tuple[str, ...]


def module_imports(package: Path = PACKAGE) -> list[Import]:
    """Every import of one jaxrl4llm module by another, at module level or inside a function."""
    modules = _module_names(package)
    found = {}
    for name, path in sorted(modules.items()):
        anchor = name if path.name == "__init__.py" else name.rpartition(".")[0]
        file = path.relative_to(package.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = anchor.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in modules else (base, a.name)
                           for a in node.names]
            for target, taken in targets:
                known = _known(target, modules)
                if known is not None and known != name:
                    names = found.setdefault((file, node.lineno, name, known), [])
                    if taken is not None:
                        names.append(taken)
    return [Import(*key, tuple(names)) for key, names in found.items()]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    graph = {name: set() for name in _module_names(package)}
    for imp in module_imports(package):
        graph[imp.importer].add(imp.imported)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_graph_sees_function_level_imports():
    # rewards/equivalence.py imports rewards/symbolic only inside its functions; the graph must see that edge
    assert "jaxrl4llm.rewards.symbolic" in import_graph()["jaxrl4llm.rewards.equivalence"]


def test_cycles_are_found():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_jaxrl4llm_modules_import_without_a_cycle():
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles among jaxrl4llm modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def package_of(module: str) -> str:
    """The package (a LAYERS entry) of a jaxrl4llm module: jaxrl4llm.train.loop -> train,
    jaxrl4llm.cli -> cli, jaxrl4llm -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def unlayered(modules, layers=LAYERS) -> list[str]:
    """The packages of `modules` that no layer lists, and the LAYERS entries listed twice or naming no package."""
    packages = {package_of(m) for m in modules}
    listed = [p for layer in layers for p in layer]
    return ([f"{p}: in no layer of LAYERS (add it where its imports put it)" for p in sorted(packages - set(listed))]
            + [f"{p}: in LAYERS twice" for p in sorted({p for p in listed if listed.count(p) > 1})]
            + [f"{p}: in LAYERS, no such package (remove it)" for p in sorted(set(listed) - packages)])


def layer_breaks(imports: list[Import], layers=LAYERS) -> list[str]:
    """Each import against the layers (the module docstring): a package importing from a higher layer,
    or one bottom-layer package from another. Layers count from 0, the bottom."""
    level = {p: i for i, layer in enumerate(layers) for p in layer}
    found = []
    for imp in imports:
        a, b = package_of(imp.importer), package_of(imp.imported)
        if a == b or a not in level or b not in level:
            continue
        where = f"{imp.file}:{imp.line} imports {imp.imported}" + (f" ({', '.join(imp.names)})" if imp.names else "")
        if level[b] > level[a]:
            found.append(f"{where}: {a} (layer {level[a]}) must not import {b} (layer {level[b]}, higher)")
        elif level[a] == level[b] == 0:
            found.append(f"{where}: {a} and {b} (layer 0, the bottom) import none of each other")
    return found


def package_loops(imports: list[Import]) -> list[str]:
    """The loops between packages (A imports B and B imports A, directly or round more packages): for each,
    its packages and one import of each edge between them."""
    graph, edges = {}, {}
    for imp in imports:
        a, b = package_of(imp.importer), package_of(imp.imported)
        graph.setdefault(a, set()), graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)
            edges.setdefault((a, b), []).append(imp)
    loops = []
    for loop in find_cycles(graph):
        shown = [f"{imps[0].file}:{imps[0].line} imports {imps[0].imported}"
                 + (f" (and {len(imps) - 1} more {a} -> {b})" if len(imps) > 1 else "")
                 for (a, b), imps in sorted(edges.items()) if a in loop and b in loop]
        loops.append(" <-> ".join(loop) + ": " + "; ".join(shown))
    return loops


def test_imports_against_the_layers_are_found(tmp_path):
    files = {
        "__init__.py": "", "storage.py": "", "cli.py": "import jaxrl4llm.train.loop\n",
        "core/__init__.py": "", "core/logprobs.py": "from jaxrl4llm.kernels.exact import token_logprobs\n",
        "kernels/__init__.py": "", "kernels/exact.py": "",
        "kernels/backend.py": "from jaxrl4llm.models.decode import DecodeBackend, KVBlock\n",
        "models/__init__.py": "", "models/decode.py": "from jaxrl4llm.kernels import exact\n",
        "sampling/__init__.py": "", "data/__init__.py": "from jaxrl4llm.rewards import extract\n",
        "rewards/__init__.py": "from jaxrl4llm import data\n", "study/__init__.py": "", "tools/__init__.py": "",
        "train/__init__.py": "", "train/loop.py": "import jaxrl4llm.storage\nfrom . import layout\n",
        "train/layout.py": "def f():\n    from jaxrl4llm.plan import lengths\n",
        "plan/__init__.py": "", "plan/lengths.py": "from ..train.loop import train\n",
    }
    for name, text in files.items():
        (tmp_path / "jaxrl4llm" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "jaxrl4llm" / name).write_text(text)
    imports = module_imports(tmp_path / "jaxrl4llm")
    assert layer_breaks(imports) == [
        "jaxrl4llm/core/logprobs.py:1 imports jaxrl4llm.kernels.exact (token_logprobs): core and kernels (layer 0, "
        "the bottom) import none of each other",
        "jaxrl4llm/kernels/backend.py:1 imports jaxrl4llm.models.decode (DecodeBackend, KVBlock): kernels (layer 0) "
        "must not import models (layer 1, higher)",
        "jaxrl4llm/train/layout.py:2 imports jaxrl4llm.plan.lengths: train (layer 3) must not import plan (layer 4, "
        "higher)"]
    assert sorted(package_loops(imports)) == [
        "data <-> rewards: jaxrl4llm/data/__init__.py:1 imports jaxrl4llm.rewards; "
        "jaxrl4llm/rewards/__init__.py:1 imports jaxrl4llm.data",  # one layer, both ways
        "kernels <-> models: jaxrl4llm/kernels/backend.py:1 imports jaxrl4llm.models.decode; "
        "jaxrl4llm/models/decode.py:1 imports jaxrl4llm.kernels.exact",
        "plan <-> train: jaxrl4llm/plan/lengths.py:1 imports jaxrl4llm.train.loop; "
        "jaxrl4llm/train/layout.py:2 imports jaxrl4llm.plan.lengths"]
    assert unlayered(_module_names(tmp_path / "jaxrl4llm")) == []
    assert unlayered(["jaxrl4llm.core", "jaxrl4llm.extra.x"], (("core", "kernels"), ("core",))) == [
        "extra: in no layer of LAYERS (add it where its imports put it)", "core: in LAYERS twice",
        "kernels: in LAYERS, no such package (remove it)"]


def test_every_package_is_in_one_layer():
    problems = unlayered(_module_names())
    assert problems == [], "LAYERS does not match the packages of jaxrl4llm/:\n" + "\n".join(problems)


def test_no_module_imports_up_the_layers():
    breaks = layer_breaks(module_imports())
    assert breaks == [], (
        "imports against the package layers (LAYERS in tests/test_imports.py, layer 0 the bottom; the rule is its "
        "docstring's). Move the imported code down to the importing package's layer or below, or the importing code "
        "up; an import inside a function is no fix:\n" + "\n".join(breaks))


def test_packages_import_each_other_one_way():
    loops = package_loops(module_imports())
    assert loops == [], ("packages that import each other: move what one needs of the other into a module below "
                         "both (or pass it in as an argument):\n" + "\n".join(loops))


def private_uses(path: Path, modules, package: Path = PACKAGE) -> list[str]:
    """`from M import _x` and `M._x` (M imported as a module) in the file at `path` (under `package`),
    M another jaxrl4llm module: "line: M._x" for each. A file's own names and dunders are not private uses."""
    own = ".".join(path.relative_to(package.parent).with_suffix("").parts)
    own = own.removesuffix(".__init__")
    tree = ast.parse(path.read_text(), str(path))
    private = lambda name: name.startswith("_") and not name.startswith("__")
    uses, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("jaxrl4llm"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:  # `from P import m`: m a module
                    aliases[a.asname or a.name] = full
                elif private(a.name) and node.module != own:
                    uses.append(f"{node.lineno}: {node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jaxrl4llm") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and private(node.attr):
            module = aliases.get(node.value.id)
            if module is not None and module != own:
                uses.append(f"{node.lineno}: {module}.{node.attr}")
    return uses


def test_private_uses_are_found(tmp_path):
    source = tmp_path / "jaxrl4llm" / "train" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("from jaxrl4llm.train.loop import _in_mesh, run_meshes\nfrom jaxrl4llm.train import hosts\n"
                      "from jaxrl4llm.train.x import _own\nhosts._local()\nhosts.fetch\n")
    modules = {"jaxrl4llm.train.hosts", "jaxrl4llm.train.loop"}
    assert private_uses(source, modules, tmp_path / "jaxrl4llm") == [
        "1: jaxrl4llm.train.loop._in_mesh", "4: jaxrl4llm.train.hosts._local"]


def test_no_module_uses_another_modules_private_names():
    """A `_name` is its module's own: another module that needs it gets it public in its owner (or moved)."""
    modules = _module_names()
    uses = {name: private_uses(path, modules) for name, path in modules.items()}
    uses = {name: found for name, found in uses.items() if found}
    assert uses == {}, "private names used across modules:\n" + "\n".join(
        f"{name}: {', '.join(found)}" for name, found in sorted(uses.items()))


# Where a jaxrl4llm module imports another inside a function, and why: file -> (the modules it may import
# so, None for any; the reason). Everything else is imported at the top of the module.
LAZY_IMPORTS = {
    "cli.py": (None, "`jaxrl4llm --help` stays fast and JAX_PLATFORMS is set before jax loads (cli.py's comment)"),
    "rewards/equivalence.py": ({"jaxrl4llm.rewards.symbolic"}, "sympy (0.4 s) loads only in the sandbox's workers"),
    "rewards/math.py": ({"jaxrl4llm.rewards.symbolic"}, "the workers' warm-up: sympy loads only there"),
    "train/config.py": ({"jaxrl4llm.models"}, "the config module, read first by every command, loads no flax "
                                               "(jaxrl4llm.models: 0.55 s more)"),
    "data/problems.py": ({"jaxrl4llm.models.hub"}, "jaxrl4llm.data stays jax-free (0.1 s): the models package "
                                                   "brings jax and flax (1.7 s), for Hub datasets only"),
}


def function_level_imports(path: Path, modules, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of each import of a jaxrl4llm module inside a function (at any depth) of the file at
    `path` (under `package`); `from P import m` names P.m when that is a module."""
    own = ".".join(path.relative_to(package.parent).with_suffix("").parts)
    anchor = own.removesuffix(".__init__") if path.name == "__init__.py" else own.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names if a.name.split(".")[0] == "jaxrl4llm")
            elif in_function and isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = anchor.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([base] if base else []))
                if base.split(".")[0] == "jaxrl4llm":
                    found.extend((child.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
                                 for a in child.names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def test_function_level_imports_are_found(tmp_path):
    source = tmp_path / "jaxrl4llm" / "train" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("import json\nfrom jaxrl4llm.train import hosts\n\n"
                      "def f():\n    import jax\n    if True:\n        from jaxrl4llm.train import loop\n"
                      "    from . import hosts as h\n\n"
                      "class C:\n    async def g(self):\n        import jaxrl4llm.data.problems\n")
    modules = {"jaxrl4llm.train.hosts", "jaxrl4llm.train.loop", "jaxrl4llm.data.problems"}
    assert function_level_imports(source, modules, tmp_path / "jaxrl4llm") == [
        (7, "jaxrl4llm.train.loop"), (8, "jaxrl4llm.train.hosts"), (12, "jaxrl4llm.data.problems")]


def test_modules_import_each_other_at_the_top():
    """A jaxrl4llm module imports another at its top, where a reader sees what it depends on; LAZY_IMPORTS
    holds the exceptions, each with its reason (an optional or slow dependency behind the imported module)."""
    modules = _module_names()
    unlisted, used = [], set()
    for name, path in sorted(modules.items()):
        file = path.relative_to(PACKAGE).as_posix()
        allowed, _ = LAZY_IMPORTS.get(file, (set(), ""))
        for line, target in function_level_imports(path, modules):
            if allowed is None or target in allowed:
                used.add((file, target) if allowed else file)
            else:
                unlisted.append(f"{file}:{line}: {target}")
    assert unlisted == [], ("imports inside functions: move them to the top of the module, or add the file and "
                            "module to LAZY_IMPORTS with the reason:\n" + "\n".join(unlisted))
    stale = [f"{file}: {target}" for file, (allowed, _) in LAZY_IMPORTS.items()
             for target in (allowed if allowed is not None else [None])
             if ((file, target) if allowed else file) not in used]
    assert stale == [], "LAZY_IMPORTS entries with no such import left (remove them):\n" + "\n".join(stale)
