"""The house's floors (docs/architecture.md), enforced: import-linter's contracts in
pyproject.toml hold, and no module of fasttrain imports itself back through others."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    """Floors import only floors below them; kernels import nothing but errors; workloads and
    techniques reach kernels only through layers and optim."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or \
        shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    done = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_no_module_imports_itself_back():
    """No cycle of imports between fasttrain's modules (lazy imports inside functions count)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("fasttrain")
    modules = sorted(graph.modules)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for nxt in sorted(graph.find_modules_directly_imported_by(m)):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in modules:
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_workloads_import_no_kernels():
    """The fused paths are chosen in layers/: no workload names a kernel module."""
    offenders = [p.name for p in (ROOT / "src" / "fasttrain" / "workloads").glob("*.py")
                 if "from ..kernels" in p.read_text() or "fasttrain.kernels" in p.read_text()]
    assert not offenders, offenders
