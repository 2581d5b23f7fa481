"""The layering docs/ARCHITECTURE.md states, checked on the source (every import, module-level
or not).

Bottom: ``substrate`` (what the systems run on), then ``simulation`` (the clock and the job
simulation, on substrate only), ``runner`` (the run lifecycle) and ``volume`` (closed forms:
numpy + substrate only).  Above:
``models`` <- ``hsadmm``, ``dataparallel``, ``sparse_sgd`` (datasets); ``partition`` <-
``sparse_sgd``.  Top: ``commvol``, and beside it the wire lab ``lab`` (a harness that runs the
other packages' commands; nothing imports it).
No package imports one above it or beside it, there are no import cycles between packages, and a
function-local import is only for an optional or heavy dependency that a run may not need.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("substrate", "simulation", "runner", "volume", "models", "hsadmm", "dataparallel",
            "partition", "sparse_sgd", "commvol", "lab")

#: which project packages each package may import (besides itself)
ALLOWED = {
    "substrate": set(),
    "simulation": {"substrate"},
    "runner": {"substrate", "simulation"},
    "volume": {"substrate"},
    "models": {"substrate", "runner"},
    "hsadmm": {"substrate", "simulation", "runner", "volume", "models"},
    "dataparallel": {"substrate", "simulation", "runner", "volume", "models"},
    "partition": {"substrate", "runner"},
    "sparse_sgd": {"substrate", "simulation", "runner", "volume", "models", "partition"},
    "commvol": {"substrate", "simulation", "runner", "volume", "models", "hsadmm", "dataparallel",
                "partition", "sparse_sgd"},
    "lab": {"substrate", "simulation", "runner", "volume", "models", "hsadmm", "dataparallel",
            "partition", "sparse_sgd", "commvol"},
}

#: top-level modules a function may import lazily, with the reason
LAZY_OK = {
    "cupy": "optional GPU backend",
    "cupyx": "optional GPU backend (CuPy extras)",
    "matplotlib": "optional plots, heavy",
    "graphblas": "optional sparse backend",
    "numba": "JIT compiler: ~40 MiB and ~0.3 s a rank, only for the kernels that use it",
    "sklearn": "optional dataset source",
    "threadpoolctl": "optional BLAS thread control",
    "torch": "optional benchmark comparator",
    "kahypar": "optional partitioner",
    "mtkahypar": "optional partitioner",
    "mpi4py": "the launcher and the wire lab's parent process must not initialise MPI",
    "pydoc_data": "a 466 KB text corpus module, loaded only when the text dataset is used",
    "tqdm": "10 MiB a rank; only rank 0 draws a bar, on a terminal",
    "scipy": "scipy.special is 17 MiB a rank; only SSFusion's Gaussian-k sparsifier uses it",
}
#: project modules that are imported lazily for the same reasons (they import the above)
LAZY_OK_PROJECT = {"models.kernels", "substrate.backend", "substrate.topology",
                   "substrate.results", "sparse_sgd.kernels", "partition.kernels",
                   "simulation.jobsim_kernel"}


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, path


def _imports(path: Path, pkg: str):
    """``(imported module, lineno, is_module_level)`` of every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    parts = path.relative_to(ROOT).with_suffix("").parts
    here = parts[:-1]             # the package a relative import starts from (__init__ too)
    top = {id(n) for n in tree.body}
    # imports under a module-level ``if``/``try`` still run at import time
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(c) for c in ast.walk(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mod = ".".join(base + ((node.module,) if node.module else ()))
                if not node.module:
                    for a in node.names:
                        yield f"{mod}.{a.name}", node.lineno, id(node) in top
                    continue
            else:
                mod = node.module
            yield mod, node.lineno, id(node) in top


def test_no_package_imports_upward_or_sideways():
    bad = []
    for pkg, path in _modules():
        for mod, line, _ in _imports(path, pkg):
            target = mod.split(".")[0]
            if target in PACKAGES and target != pkg and target not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_nothing_imports_the_lab():
    """The wire lab is on the top floor: it runs the other packages' commands, none imports it
    (``substrate`` holds only what the systems run on)."""
    assert all("lab" not in ALLOWED[p] for p in PACKAGES if p != "lab")
    bad = [f"{path.relative_to(ROOT)}:{line} imports {mod}"
           for pkg, path in _modules() if pkg != "lab"
           for mod, line, _ in _imports(path, pkg) if mod.split(".")[0] == "lab"]
    assert not bad, "the wire lab is imported by:\n" + "\n".join(bad)
    assert not (ROOT / "substrate" / "wirelab.py").exists()


def test_the_allowed_arrows_form_a_dag():
    """The layering itself has no cycle (an edit of :data:`ALLOWED` that lets two packages import
    each other fails here, before any import does)."""
    _assert_acyclic({p: set(ALLOWED[p]) for p in PACKAGES}, "allowed arrows")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _assert_acyclic(edges: dict, what: str) -> None:
    seen, stack = set(), []

    def visit(p):
        if p in stack:
            pytest.fail(f"{what}: import cycle " + " -> ".join(stack[stack.index(p):] + [p]))
        if p in seen:
            return
        stack.append(p)
        for q in sorted(edges.get(p, ())):
            visit(q)
        stack.pop()
        seen.add(p)

    for p in sorted(edges):
        visit(p)


def module_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports at import time (module-level imports; ``from pkg
    import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``)."""
    modules = {_module_name(path): path for _, path in _modules()}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for pkg, path in _modules():
        me = _module_name(path)
        for mod, _, module_level in _imports(path, pkg):
            if not module_level:
                continue
            target = mod if mod in modules else mod.rsplit(".", 1)[0]
            if target in modules and target != me:
                edges[me].add(target)
    return edges


def test_no_import_cycles_between_modules():
    """No module imports itself back through others at import time (inside or across packages:
    the package arrows above cannot see a cycle inside one package)."""
    _assert_acyclic(module_graph(), "modules")


def test_the_cycle_check_finds_a_cycle():
    edges = module_graph()
    edges["substrate.costmodel"] = edges["substrate.costmodel"] | {"substrate.calls"}
    with pytest.raises(pytest.fail.Exception, match="substrate.calls"):
        _assert_acyclic(edges, "modules")


def test_function_local_imports_only_for_optional_heavy_dependencies():
    bad = []
    for pkg, path in _modules():
        for mod, line, module_level in _imports(path, pkg):
            if module_level:
                continue
            if mod.split(".")[0] in LAZY_OK or mod in LAZY_OK_PROJECT:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} inside a function")
    assert not bad, ("function-local imports of ordinary modules (import them at the top, or "
                     "add the dependency to LAZY_OK with its reason):\n" + "\n".join(bad))


def test_volume_imports_only_numpy_and_substrate():
    for path in sorted((ROOT / "volume").glob("*.py")):
        for mod, line, _ in _imports(path, "volume"):
            top = mod.split(".")[0]
            assert top in {"__future__", "math", "numpy", "substrate", "volume", "collections",
                           "dataclasses", "typing", "itertools", "functools"}, \
                f"{path.name}:{line} imports {mod}"


def test_offline_commands_start_no_mpi():
    """``commvol`` predicts, scales, simulates and reports without initialising MPI: its
    modules import no ``mpi4py.MPI`` (a fresh interpreter, so nothing else loaded it)."""
    import subprocess
    import sys

    code = ("import sys, commvol.__main__, commvol.predict, commvol.scale, commvol.simulate, "
            "commvol.job, commvol.report, runner.options; "
            "print('mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip()
    assert out == "False"
