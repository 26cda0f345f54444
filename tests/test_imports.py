"""The import graph of the project's code: no circles (module-level and function-level imports
alike), no private jax/orbax modules, `pallas_kernels/` and `sharding/` free of the model, and no
backend check outside dsv3_jax/host.py (code that must differ per platform uses
`lax.platform_dependent`, decided when the program is lowered, not by the host it is traced on)."""

import ast
import os

import pytest

from tests.helpers import REPO

PACKAGES = ("dsv3_jax", "sharding", "pallas_kernels", "experiments", "benchmarks", "research")
PRIVATE = ("jax._src", "orbax.checkpoint._src")
HOST_MODULE = "dsv3_jax.host"


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every .py file in PACKAGES."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imported(module: str, tree: ast.AST) -> list[str]:
    """Every module name an `import` or `from ... import` anywhere in `tree` names (a `from a import
    b` names `a.b` as well, which is a module when b is one)."""
    is_package = MODULES[module].endswith("__init__.py")
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def _graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}; importing `a.b.c` imports the packages a and a.b."""
    graph = {}
    for module, path in MODULES.items():
        with open(path) as f:
            names = _imported(module, ast.parse(f.read(), path))
        edges = set()
        for name in names:
            parts = name.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES)
        edges.discard(module)
        edges -= {p for p in edges if module.startswith(p + ".")}  # a module's own packages run before it
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle_through_a_package_and_none_in_a_chain():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_jax_or_orbax_imports():
    bad = [f"{m}: {name}" for m, path in MODULES.items()
           for name in _imported(m, ast.parse(open(path).read(), path))
           if any(name == p or name.startswith(p + ".") for p in PRIVATE)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["pallas_kernels", "sharding"])
def test_kernels_and_sharding_know_no_model(package):
    graph = _graph()
    bad = [f"{m} -> {dep}" for m in graph if m.split(".")[0] == package
           for dep in graph[m] if dep.split(".")[0] == "dsv3_jax"]
    assert not bad, "\n".join(bad)


def _backend_checks(source: str) -> list[int]:
    """Lines that compare the host's backend: `default_backend()` or a `.platform` attribute (of a
    device; `sys.platform` is the operating system) on either side of a comparison."""
    def backend(node) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            return getattr(node.func, "attr", getattr(node.func, "id", None)) == "default_backend"
        return (isinstance(node, ast.Attribute) and node.attr == "platform"
                and not (isinstance(node.value, ast.Name) and node.value.id == "sys"))

    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            and any(backend(side) for side in (node.left, *node.comparators))]


def test_the_backend_check_finder_sees_the_usual_spellings():
    code = ("a = jax.default_backend() == 'cpu'\nb = x.platform in ('tpu', 'gpu')\nc = jax.devices()[0].platform != 'gpu'\n"
            "d = sys.platform == 'linux'\ne = default_backend()\n")
    assert _backend_checks(code) == [1, 2, 3]


def test_no_backend_checks_outside_the_host_module():
    bad = [f"{os.path.relpath(MODULES[m], REPO)}:{line}" for m in MODULES if m != HOST_MODULE
           for line in _backend_checks(open(MODULES[m]).read())]
    assert not bad, "backend checks (use dsv3_jax/host.py or lax.platform_dependent):\n" + "\n".join(bad)
