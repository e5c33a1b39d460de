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
The same graph keeps core's groups in layers (``CORE_LAYERS``). Two tests run fresh
interpreters: each package imported first (a package half initialised by its own modules
fails only in some orders), ``core.jobs.dispatch`` (what the API imports to enqueue)
building no Celery app and connecting no worker signal handlers, and ``api.main`` loading no
ML library.
"""

from __future__ import annotations

import ast
import functools
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


@functools.cache  # the tree does not change during a run; every test reads the same graph
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


def test_the_api_process_loads_no_ml_library() -> None:
    """Run, not read (the graph above holds project modules only): the data checks the API
    makes at submit live in core/data beside the code that builds tensors, which imports
    torch where it does so (core/data/packing.py). torch alone cost every API and CLI
    process seconds and hundreds of MB."""
    heavy = ("torch", "transformers", "peft", "trl", "datasets", "accelerate")
    code = f"import sys, api.main; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"


# core's groups from the bottom up. A module of one group imports only its own group and the
# groups before it; nothing in core imports the trainer, which comes last.
#   spec      what a job is: the vocabulary every layer speaks (pydantic only; the operator's
#             settings name its trackers and catalog models, so it sits below infra)
#   infra     what every process shares: settings, logging, errors, paths, the broker
#   data      dataset files and formats, and the row pipeline (tokenize, pack, collate)
#   model     the model a spec describes before any weight is read: PEFT config, LM head
#             choice, the memory estimate
#   graders   scoring answers (the sandbox, the judge, the metrics)
#   policy    what may run where (admission rules, placement, memory fit)
#   run       the trainer's boundary: the run plan, the job directory, checkpoint rules
#   db        the tables and sessions
#   webhooks  the outbox written beside a status change
#   jobs      the job domain over the database: state machine, scheduler, usage, dispatch
#   serving   deployments of the inference engine: model names per tenant, adapters, the
#             engine's command line (an eval run is a client of a deployment)
#   evals     eval runs: a client of a deployment plus graders, dispatched as jobs are
#   train     the trainer
CORE_LAYERS = (
    "spec", "infra", "data", "model", "graders", "policy", "run", "db", "webhooks", "jobs",
    "serving", "evals", "train",
)


# Known imports against the order, each with why it stands and where it goes: none today.
KNOWN_UPWARD: set[str] = set()


def _core_group(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "core" and len(parts) > 1 else None


def test_every_core_module_lives_in_a_layer() -> None:
    """core/ holds its groups and nothing loose: a new group takes its place in CORE_LAYERS."""
    stray = sorted(
        m for m in project_modules() if m.startswith("core.") and _core_group(m) not in CORE_LAYERS
    )
    assert stray == []


def test_core_groups_import_only_the_layers_below_them() -> None:
    rank = {group: i for i, group in enumerate(CORE_LAYERS)}
    upward = sorted(
        f"{mod} -> {dep}"
        for mod, deps in import_graph().items()
        if (group := _core_group(mod)) in rank
        for dep in deps
        if (to := _core_group(dep)) in rank and rank[to] > rank[group]
    )
    upward = [edge for edge in upward if edge not in KNOWN_UPWARD]
    assert upward == [], "imports that run up core's layers:\n" + "\n".join(upward)


def _packages() -> list[str]:
    return sorted(
        _module_name(p.parent)
        for pkg in ("core", "api", "worker", "cli", "client")
        for p in (REPO_ROOT / pkg).rglob("__init__.py")
    )


def test_each_package_imports_first_in_a_fresh_interpreter() -> None:
    """Every package imported first, alone, in its own interpreter: a package whose modules
    import each other while its __init__ is half run (core/data/formats did: __init__ ->
    detect -> registry -> `from core.data.formats import alpaca`) fails only when it is
    imported before the module that happens to finish it, which the other tests never see."""
    from concurrent.futures import ThreadPoolExecutor

    def first(package: str) -> tuple[str, str]:
        proc = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=REPO_ROOT,
                              capture_output=True, text=True, check=False)
        return package, proc.stderr[-2000:] if proc.returncode else ""

    packages = _packages()
    assert {"core.data.formats", "core.spec", "api.services.jobs"} <= set(packages)
    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = {p: err for p, err in pool.map(first, packages) if err}
    assert failed == {}
