"""The package's import graph: acyclic, model code free of logging, data and MLPerf modules,
offline preparation (rnnt/prep) out of reach of everything a run imports, the kernels package
free of Triton until a kernel is used, and test modules that share helpers only through
tests/helpers.py and tests/conftest.py."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_CODE = ("rnnt.model", "rnnt.loss", "rnnt.decoding", "rnnt.kernels")
NOT_IN_MODEL_CODE = ("logging", "nvidia", "mlperf_logging", "apex", "rnnt.run_log", "rnnt.mlperf")
PREP = "rnnt.prep"
# the programs of offline preparation: the only modules outside rnnt/prep that import it
PREP_PROGRAMS = (
    "rnnt.cli.build_manifest",
    "rnnt.cli.validate_dataset",
    "rnnt.cli.make_synthetic_corpus",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            # `from rnnt.kernels import lstm_wave` imports the submodule
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in (ROOT / "rnnt").rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}


def _reached(graph: dict[str, set[str]], names: set[str]) -> set[str]:
    """`names` and every module they import, directly or through others."""
    reached, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += graph[name]
    return reached


def test_the_package_import_graph_is_acyclic():
    graph = _graph()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            cycle = " -> ".join(path[path.index(name) :] + (name,))
            raise AssertionError(f"import cycle: {cycle}")
        if name in done:
            return
        for dep in sorted(graph[name]):
            # a package's own __init__ is imported with each of its modules, not a cycle
            if not name.startswith(dep + "."):
                visit(dep, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())
    assert len(done) == len(graph) > 40


def test_model_code_imports_no_logging_data_or_mlperf_code():
    graph = _graph()
    paths = {_module_name(p): p for p in (ROOT / "rnnt").rglob("*.py")}
    reached = _reached(graph, {n for n in graph if n.startswith(MODEL_CODE)})
    assert not any(n.startswith("rnnt.data") for n in reached), sorted(reached)
    for name in reached:
        bad = [m for m in _imports(paths[name]) if m.startswith(NOT_IN_MODEL_CODE)]
        assert not bad, f"{name} imports {bad}"


def test_nothing_a_run_imports_reaches_the_preparation_package():
    """rnnt/prep runs offline, before any run: it may import rnnt/data, but rnnt/data, the
    trainer, the model and every other module but the preparation programs never reach it."""
    graph = _graph()
    prep = {n for n in graph if n == PREP or n.startswith(PREP + ".")}
    assert {f"{PREP}.validate", f"{PREP}.manifests"} <= prep
    assert set(PREP_PROGRAMS) <= set(graph)
    run = set(graph) - prep - set(PREP_PROGRAMS)
    assert {"rnnt.data.manifest", "rnnt.data.preflight", "rnnt.trainer", "rnnt.cli.train"} <= run
    # every path from there into rnnt/prep leaves `run` by one import, named here
    for name in sorted(run):
        bad = sorted(graph[name] & (prep | set(PREP_PROGRAMS)))
        assert not bad, f"{name} imports {bad}"
    assert not _reached(graph, run) & prep


def test_the_kernels_package_and_the_model_import_no_triton():
    code = (
        "import sys, rnnt.kernels, rnnt.model, rnnt.loss, rnnt.optim.lamb;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_test_modules_share_helpers_only_through_the_helpers_module():
    for path in (ROOT / "tests").rglob("test_*.py"):
        shared = [m for m in _imports(path) if m.startswith("tests.")]
        shared = [m for m in shared if m.split(".")[:2] != ["tests", "helpers"]]
        assert not shared, f"{path.relative_to(ROOT)} imports {shared}"
