"""Run a fasttrain command with class attributes of fasttrain changed, for A/B runs of a layer
behaviour that is not a recipe switch (SD's ``stacked`` projections, say):

    python3 benchmarks/runs/with_attrs.py fasttrain.layers.sd_transformer.Attention.stacked=False \
        -- train sd --recipe F.toml

imports ``fasttrain.layers.sd_transformer``, sets ``Attention.stacked = False`` (values are
Python literals; the attribute must exist) and then runs ``fasttrain train sd --recipe F.toml`` in the same
process. The row it prints is the command's own: say which setting it ran with where you keep
it (train_rows.py's file is in run order).
"""
from __future__ import annotations

import ast
import importlib
import sys


def set_attr(setting: str) -> str | None:
    """Apply ``module.path.Class.attr=VALUE``; the error as a line, or None."""
    key, _, value = setting.partition("=")
    parts = key.split(".")
    for cut in range(len(parts) - 2, 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            obj = getattr(obj, name, None)
        if obj is None or not hasattr(obj, parts[-1]):
            return f"{key}: no such attribute"
        try:
            setattr(obj, parts[-1], ast.literal_eval(value))
        except (ValueError, SyntaxError):
            return f"{key}: {value!r} is not a Python literal"
        return None
    return f"{key}: no importable module in it"


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: with_attrs.py MODULE.CLASS.ATTR=VALUE ... -- FASTTRAIN-ARGS", file=sys.stderr)
        return 2
    cut = argv.index("--")
    for setting in argv[:cut]:
        if (err := set_attr(setting)) is not None:
            print(err, file=sys.stderr)
            return 2
        print(f"with {setting}", flush=True)
    from fasttrain.cli import main as fasttrain

    return fasttrain(argv[cut + 1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
