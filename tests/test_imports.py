"""The jaxrl4llm modules import each other without a cycle, none uses another's private (`_x`) names, and
they import each other at the top of the module (LAZY_IMPORTS lists the exceptions and why).

The graph is read from the source (ast, nothing imported): an edge A -> B for every
`import B` / `from B import x` in A, at module level or inside a function, B a jaxrl4llm
module (`from P import m` is an edge to the module P.m when m is one, else to P's __init__).
A cycle means two modules each need the other: one of them holds a piece that belongs lower.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxrl4llm"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _known(name: str, modules) -> str | None:
    """The longest prefix of a dotted name that is a jaxrl4llm module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                known = _known(target, modules)
                if known is not None and known != name:
                    graph[name].add(known)
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
