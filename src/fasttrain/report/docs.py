"""``fasttrain docs``: the generated pages under docs/, written or checked against the committed
ones. Run from the repository root (where docs/ and src/fasttrain/recipe.py are)."""
from __future__ import annotations

from pathlib import Path

from ..errors import FasttrainError
from ..measure.files import write_atomic
from .recipe_doc import render_recipe_file
from .results_doc import render_results

RECIPE_SOURCE = Path("src/fasttrain/recipe.py")
RESULTS_SPEC = Path("docs/results.toml")
RESULTS_ROWS = Path("benchmarks/results")
PAGES = (Path("docs/recipe.md"), Path("docs/results.md"))


def generated(root: str | Path = ".") -> dict[Path, str]:
    """Each generated page (path relative to ``root``) and the text it should hold."""
    root = Path(root)
    if not (root / RECIPE_SOURCE).is_file() or not (root / "docs").is_dir():
        raise FasttrainError(f"docs: run it from the repository root (no {RECIPE_SOURCE} and "
                             f"docs/ under {root.resolve()})")
    return {PAGES[0]: render_recipe_file(root / RECIPE_SOURCE),
            PAGES[1]: render_results(root / RESULTS_SPEC, root / RESULTS_ROWS)}


def stale(root: str | Path = ".") -> list[Path]:
    """The pages whose committed text differs from what :func:`generated` makes."""
    root = Path(root)
    return [page for page, text in generated(root).items()
            if not (root / page).is_file() or (root / page).read_text() != text]


def write(root: str | Path = ".") -> list[Path]:
    """Write every generated page (atomically); returns the ones whose text changed."""
    root = Path(root)
    pages = generated(root)  # everything rendered before anything is written
    changed = [p for p, text in pages.items()
               if not (root / p).is_file() or (root / p).read_text() != text]
    for page in changed:
        write_atomic(root / page, pages[page])
    return changed
