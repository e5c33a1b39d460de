"""No import cycles among the project's own modules.

What counts as a cycle here: the graph has an edge A -> B when module A has an ``import B``
or ``from B import ...`` (or ``from B import name`` where ``B.name`` is itself a module)
anywhere in its source, at module level or inside a function, class or ``if
TYPE_CHECKING:``. Function-level imports count too: deferring an import into a function
hides a cycle from Python's import machinery but not the dependency, and the circles this
test was written for (``worker.queue.celery_app -> reconciler -> dispatch -> celery_app``,
``cli.main <-> cli.demo``) were exactly that. Relative imports are resolved; imports of
anything outside the project are ignored. A package depends on its ``__init__`` (Python
imports that first), so ``a.b -> a`` is not an edge unless written.

Read with ``ast`` only, nothing is imported, so the test is fast and has no side effects.
The second test checks, in a fresh interpreter, that importing ``core.jobs.dispatch`` (what
the API imports to enqueue) builds no Celery app and connects no worker signal handlers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "core", "api", "worker", "cli", "client", "migrations", "bench", "testkit", "tests"
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            mods[_module_name(path)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to, or the closest enclosing one."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    source = ".".join(p for p in (base, node.module or "") if p)
                else:
                    source = node.module or ""
                # `from pkg import mod` depends on pkg.mod; `from mod import name` on mod.
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source
                           for a in node.names]
            for target in targets:
                dep = _resolve(target, mods)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_a_cycle(graph, comp) for comp in components]


def _a_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A concrete path start -> ... -> start inside the component, for the failure message."""
    members = set(comp)
    start = comp[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return comp  # pragma: no cover - a component always has a cycle through its first node


def test_graph_sees_the_project() -> None:
    graph = import_graph()
    assert "worker.queue.tasks" in graph and "cli.main" in graph
    assert "worker.queue.celery_app" in graph["worker.queue.tasks"]  # module level
    assert "core.jobs.dispatch" in graph["worker.upkeep.reconciler"]  # function level


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_project_modules() -> None:
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_nothing_outside_tests_imports_tests() -> None:
    """bench/ and testkit/ (and the service) may not lean on tests/: what they share with
    the tests lives in testkit/."""
    leaks = sorted(
        f"{mod} -> {dep}"
        for mod, deps in import_graph().items()
        if not mod.startswith("tests")
        for dep in deps
        if dep == "tests" or dep.startswith("tests.")
    )
    assert leaks == []


def test_importing_dispatch_builds_no_celery_app_and_connects_no_worker_hooks() -> None:
    code = (
        "import sys\n"
        "from celery import signals\n"
        "import core.jobs.dispatch\n"
        "print('worker.queue.celery_app' in sys.modules, 'worker.queue.tasks' in sys.modules,\n"
        "      bool(signals.worker_init.receivers), bool(signals.task_prerun.receivers))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", "False", "False", "False"]


def test_api_imports_nothing_from_worker() -> None:
    """The API enqueues through core (core/jobs/dispatch.py, core/infra/broker.py); what it shares with
    the worker lives in core/, so an API process never loads the worker's modules."""
    leaks = sorted(
        f"{mod} -> {dep}"
        for mod, deps in import_graph().items()
        if mod == "api" or mod.startswith("api.")
        for dep in deps
        if dep == "worker" or dep.startswith("worker.")
    )
    assert leaks == []
