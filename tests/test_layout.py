"""The house's shape, from the code's own imports (every import statement, at any depth in
a file: a function-level import is an arrow too).

- No import circles among the files of router/, worker/, shared/, loadtests/.
- router/'s deepest import chain (its files only) is at most 8 files; worker/'s at most 9.
- worker/ keeps at most 6 modules at its top level (every .py file directly in it,
  __init__.py and __main__.py included); the rest live in its rooms.
- worker/engine/radix_cache.py stays at most 450 lines (the host tier is its own cache).
- No class or function name is defined twice at the top level of router/, worker/,
  shared/, but for each deployable's own entry points and route handlers (`SAME_FACE`).
- README's "Layout" list names folders that exist, and every package folder of router/
  and worker/ is on it.
- loadtests/ is in five section folders (the package's own `__init__`, `__main__` and
  `kit` aside), every module reached by imports from the command table of
  `loadtests/__main__.py`: the sections but gpu/ and the top at most 32, gpu/ (one
  command, issue 32) at most 8, and 40 in all (issue 36's target).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "worker", "shared", "loadtests")
MAX_ROUTER_DEPTH = 8
MAX_LOADTEST_MODULES = 32  # all but gpu/: a new command goes into its section's module
MAX_GPU_MODULES = 8  # one command: driver, sections, report, and what they measure
MAX_LOADTEST_TOTAL = 40  # issue 36
LOADTEST_SECTIONS = ("load", "simulate", "router", "engine", "gpu")
MAX_WORKER_DEPTH = 9
MAX_WORKER_TOP = 6
MAX_RADIX_CACHE_LINES = 450
# Names each deployable defines for itself (the router never imports the worker): its
# command's `main`, its app factory and serve loop, and handlers named for their route.
SAME_FACE = frozenset({"main", "create_app", "serve", "health", "metrics", "models", "openapi"})


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `path` names in any import statement."""
    found: set[str] = set()
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a import b` names the module a.b when there is one, else a.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in known)
    found.discard(module_name(path))
    return found


@cache
def graph() -> dict[str, frozenset[str]]:
    known = modules()
    return {name: frozenset(imports_of(path, known)) for name, path in known.items()}


def cycles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def deepest_chain(edges: dict[str, frozenset[str]]) -> list[str]:
    """The longest import chain (in files) of an acyclic graph."""
    best: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in best:
            below = [chain(child) for child in sorted(edges[node])]
            best[node] = [node, *max(below, key=len, default=[])]
        return best[node]

    return max((chain(node) for node in sorted(edges)), key=len, default=[])


def test_cycle_finder_finds_a_circle_held_open_by_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    known = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        edges = {name: frozenset(imports_of(path, known)) for name, path in known.items()}
    finally:
        ROOT = saved
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.a"}
    assert cycles(edges) == [["pkg.a", "pkg.b"]]
    assert deepest_chain({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset()}) == [
        "a",
        "b",
        "c",
    ]


def test_no_import_circles() -> None:
    assert cycles(graph()) == []


def test_router_import_chain_is_short() -> None:
    edges = graph()
    router = {
        n: frozenset(m for m in e if m.startswith("router"))
        for n, e in edges.items()
        if n.startswith("router")
    }
    chain = deepest_chain(router)
    assert len(chain) <= MAX_ROUTER_DEPTH, " -> ".join(chain)


def test_worker_import_chain_is_short() -> None:
    """Counted in worker/ files, as the router's chain is in router/ files."""
    worker = {
        n: frozenset(m for m in e if m.startswith("worker"))
        for n, e in graph().items()
        if n.startswith("worker")
    }
    chain = deepest_chain(worker)
    assert len(chain) <= MAX_WORKER_DEPTH, " -> ".join(chain)


def test_worker_top_level_is_small_and_the_radix_cache_is_one_tier() -> None:
    top = sorted(p.name for p in (ROOT / "worker").glob("*.py"))
    assert len(top) <= MAX_WORKER_TOP, top
    lines = len((ROOT / "worker/engine/radix_cache.py").read_text().splitlines())
    assert lines <= MAX_RADIX_CACHE_LINES, lines


def top_level_names(path: Path) -> set[str]:
    return {
        node.name
        for node in ast.parse(path.read_text(), str(path)).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


def test_no_name_is_defined_twice_in_product_code() -> None:
    where: dict[str, list[str]] = {}
    for top in ("router", "worker", "shared"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for name in top_level_names(path):
                where.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    twice = {n: files for n, files in where.items() if len(files) > 1 and n not in SAME_FACE}
    assert not twice, twice


def test_the_duplicate_name_check_sees_a_class_and_a_function(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("class TreeNode:\n    pass\n\ndef helper():\n    pass\n")
    (tmp_path / "b.py").write_text("from typing import Protocol\nclass TreeNode(Protocol): ...\n")
    assert top_level_names(tmp_path / "a.py") & top_level_names(tmp_path / "b.py") == {"TreeNode"}


def test_router_never_imports_worker_and_back() -> None:
    for name, targets in graph().items():
        top = name.split(".")[0]
        other = {"router": "worker", "worker": "router"}.get(top)
        assert not any(t.split(".")[0] == other for t in targets), (name, sorted(targets))


def test_readme_layout_matches_the_folders() -> None:
    text = (ROOT / "README.md").read_text()
    layout = text.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)*)/`", layout))
    for folder in named:
        candidates = [
            ROOT / folder,
            *(ROOT / top / folder for top in ("router", "worker", "shared")),
        ]
        assert any(c.is_dir() for c in candidates), folder
    for top in ("router", "worker", "shared"):
        for init in (ROOT / top).rglob("__init__.py"):
            folder = init.parent.relative_to(ROOT / top).as_posix()
            if folder == "." or "/attention" in folder:
                continue
            assert folder in named or f"{top}/{folder}" in named, (
                f"{top}/{folder} is not in the Layout"
            )


def test_the_engine_is_torch_free_and_the_runtime_holds_the_torch_side() -> None:
    """worker/engine/ (its runtime/ aside) imports neither torch nor triton nor its own
    runtime, nor aiohttp or Redis, at any depth in a file; every module that imports
    torch or triton is under runtime/ (or is the tools that make models)."""
    heavy = ("torch", "triton", "aiohttp", "redis")
    for name, path in modules().items():
        tops = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                tops.add(node.module)
        if name.startswith("worker.engine") and not name.startswith("worker.engine.runtime"):
            bad = {
                t for t in tops if t.split(".")[0] in heavy or t.startswith("worker.engine.runtime")
            }
            assert not bad, (name, sorted(bad))
        if name.startswith("worker.") and any(t.split(".")[0] in ("torch", "triton") for t in tops):
            assert name.startswith(("worker.engine.runtime", "worker.models")), name


MAX_POLICY_LINES = 700


def test_policies_only_select() -> None:
    """router/policy/ stays small and its base class has one public method: what workers
    hold is the holdings room's (router/holdings/), a policy only selects (issue 30)."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "router/policy").rglob("*.py"))
    assert lines <= MAX_POLICY_LINES, lines
    tree = ast.parse((ROOT / "router/policy/base.py").read_text())
    policy = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Policy")
    methods = [
        n.name
        for n in policy.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and not n.name.startswith("_")
    ]
    assert methods == ["select"], methods


def test_the_app_is_wired_without_hasattr_or_type_ignores() -> None:
    """A missing interface shows as `hasattr` or a silenced type error where parts meet."""
    text = (ROOT / "router/http/app.py").read_text()
    assert "hasattr(" not in text and "type: ignore" not in text


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text(), str(path)).body
    return len(body) <= 1 and all(isinstance(n, ast.Expr) for n in body)


def loadtest_modules() -> dict[str, Path]:
    """How loadtests/ is counted: every .py file under it, but an `__init__.py` that holds
    only its docstring (a section folder's sign; nothing can hide there)."""
    return {
        name: path
        for name, path in modules().items()
        if name.split(".")[0] == "loadtests"
        and not (path.name == "__init__.py" and _docstring_only(path))
    }


def test_loadtests_are_few_modules_in_five_sections() -> None:
    found = loadtest_modules()
    gpu = {name for name in found if name.startswith("loadtests.gpu.")}
    assert len(found) - len(gpu) <= MAX_LOADTEST_MODULES, sorted(set(found) - gpu)
    assert len(gpu) <= MAX_GPU_MODULES, sorted(gpu)
    assert len(found) <= MAX_LOADTEST_TOTAL, sorted(found)
    for init in (ROOT / "loadtests").rglob("__init__.py"):
        assert _docstring_only(init), f"{init} holds code: it would be a module not counted"
    top = {"loadtests.__main__", "loadtests.kit"}
    folders = {p.name for p in (ROOT / "loadtests").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LOADTEST_SECTIONS)
    for name in found:
        assert name in top or name.split(".")[1] in LOADTEST_SECTIONS, name


def test_every_loadtests_module_is_reached_from_the_command_table() -> None:
    """From `__main__` and every module its COMMANDS name, by imports at any depth; the
    locustfile is started by file (`locust -f`), from the one module that names it."""
    from loadtests.__main__ import COMMANDS

    edges = graph()
    todo = ["loadtests.__main__", *(target.partition(":")[0] for target, _ in COMMANDS.values())]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += edges[name]
    runner = (ROOT / "loadtests" / "load" / "runner.py").read_text()
    assert "loadtests.load.runner" in seen and 'with_name("locustfile.py")' in runner
    seen.add("loadtests.load.locustfile")
    assert set(loadtest_modules()) - seen == set()
