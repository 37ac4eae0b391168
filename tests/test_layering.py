"""The layers run one way (engine < router < launcher) and no two modules import each other.

The import graph is read from the source with ast, lazy imports inside functions included: a
function-level import is still a dependency, only a later one.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("engine", "router", "launcher")  # lowest first
MAX_ENGINE_ROOT_MODULES = 10
MAX_ROUTER_ROOT_MODULES = 6


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_names(node: ast.AST, package: str) -> list[str]:
    """Every module name an import statement may load: `from a.b import c` may be a.b or a.b.c."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def import_graph(root: Path, packages=LAYERS) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(
                    d
                    for d in imported_names(node, package_of(name, path))
                    if d in files and d != name
                )
        graph[name] = deps
    return graph


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    rank = {layer: i for i, layer in enumerate(layers)}
    return sorted(
        f"{src} imports {dst}"
        for src, deps in graph.items()
        for dst in deps
        if rank[dst.split(".")[0]] > rank[src.split(".")[0]]
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_goes_up_a_layer():
    assert upward_imports(import_graph(ROOT)) == []


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def folder_graph(graph: dict[str, set[str]], layers=LAYERS) -> dict[str, set[str]]:
    """Imports between the folders below each layer (engine.models -> engine.layers, ...). A layer's
    root modules are the shared ground of its folders and are left out."""
    folders = {
        m for m in graph if m.count(".") == 1 and any(other.startswith(m + ".") for other in graph)
    }

    def folder(module: str) -> str | None:
        top = ".".join(module.split(".")[:2])
        return top if top in folders else None

    out: dict[str, set[str]] = {}
    for src, deps in graph.items():
        if (a := folder(src)) is not None:
            out.setdefault(a, set()).update(b for d in deps if (b := folder(d)) not in (None, a))
    return out


def test_no_import_cycles_between_folders():
    assert cycles(folder_graph(import_graph(ROOT))) == []


def test_engine_root_holds_only_the_shared_modules():
    modules = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(modules) <= MAX_ENGINE_ROOT_MODULES, modules


def test_router_root_holds_only_its_entry_points():
    modules = sorted(p.name for p in (ROOT / "router").glob("*.py"))
    assert len(modules) <= MAX_ROUTER_ROOT_MODULES, modules


def serving_imports(graph: dict[str, set[str]]) -> list[str]:
    """The router reaches the shard only through the wire contract (engine.wire), never the shard's
    own serving code."""
    return sorted(
        f"{src} imports {dst}"
        for src, deps in graph.items()
        if src.split(".")[0] == "router"
        for dst in deps
        if dst == "engine.serving" or dst.startswith("engine.serving.")
    )


def test_the_router_imports_the_wire_not_the_shard():
    assert serving_imports(import_graph(ROOT)) == []


def test_the_sched_wing_imports_no_http():
    graph = import_graph(ROOT)
    assert (
        sorted(
            f"{s} imports {d}"
            for s, deps in graph.items()
            if s.startswith("router.sched")
            for d in deps
            if d.startswith("router.http")
        )
        == []
    )


def test_every_folder_says_what_it_holds():
    for init in [p for pkg in LAYERS for p in (ROOT / pkg).rglob("__init__.py")]:
        assert ast.get_docstring(ast.parse(init.read_text())), (
            f"{init.relative_to(ROOT)} has no docstring"
        )


# --- the checks themselves catch what they should ---------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
        for pkg in LAYERS:
            (tmp_path / pkg).mkdir(exist_ok=True)
            (tmp_path / pkg / "__init__.py").touch()
        return tmp_path

    return write


def test_an_upward_import_is_found_also_inside_a_function(tree):
    root = tree(
        {
            "engine/a.py": "def f():\n    from router.b import x\n",
            "router/b.py": "x = 1\n",
            "router/c.py": "import launcher.d\n",
            "launcher/d.py": "import engine.a\n",
        }
    )
    assert upward_imports(import_graph(root)) == [
        "engine.a imports router.b",
        "router.c imports launcher.d",
    ]


def test_a_cycle_through_a_relative_lazy_import_is_found(tree):
    root = tree(
        {
            "engine/w/__init__.py": "",
            "engine/w/run.py": "def go():\n    from .prog import p\n",
            "engine/w/prog.py": "from engine.w.run import go\n",
            "engine/ok.py": "from engine.w import run\n",
        }
    )
    assert cycles(import_graph(root)) == [["engine.w.prog", "engine.w.run"]]


def test_a_router_import_of_the_shard_serving_code_is_found(tree):
    root = tree(
        {
            "engine/serving/__init__.py": "",
            "engine/serving/server.py": "K = 1\n",
            "engine/wire/__init__.py": "",
            "engine/wire/contract.py": "K = 1\n",
            "router/c.py": "def f():\n    from engine.serving.server import K\n",
            "router/d.py": "from engine.wire.contract import K\n",
        }
    )
    assert serving_imports(import_graph(root)) == ["router.c imports engine.serving.server"]


def test_a_cycle_between_folders_is_found(tree):
    root = tree(
        {
            "engine/layers/__init__.py": "",
            "engine/layers/rotary.py": "from engine.models.config import R\n",
            "engine/models/__init__.py": "from engine.models.llama import M\n",
            "engine/models/config.py": "R = 1\n",
            "engine/models/llama.py": "from engine.layers.rotary import x\n",
        }
    )
    assert cycles(import_graph(root)) == []
    assert cycles(folder_graph(import_graph(root))) == [["engine.layers", "engine.models"]]
