"""Run a fasttrain command with launch settings of a kernel module changed, for A/B runs of a
setting that is not a recipe switch (a tile size, warps, programs per SM):

    python3 benchmarks/with_launch.py window_attention programs_per_sm=4 -- train swin --recipe F.toml

sets ``fasttrain.kernels.window_attention.LAUNCH["programs_per_sm"] = 4`` (values are parsed
as Python literals where they are one: ints, floats, booleans) and then runs ``fasttrain train
swin --recipe F.toml`` in the same process. The row it prints is the command's own; say which
setting it ran with where you keep it.
"""
from __future__ import annotations

import ast
import importlib
import sys


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") < 1:
        print("usage: with_launch.py MODULE KEY=VALUE ... -- FASTTRAIN-ARGS", file=sys.stderr)
        return 2
    cut = argv.index("--")
    module = importlib.import_module(f"fasttrain.kernels.{argv[0]}")
    for setting in argv[1:cut]:
        key, _, value = setting.partition("=")
        if key not in module.LAUNCH:
            print(f"{argv[0]}.LAUNCH has no {key!r} (has {', '.join(module.LAUNCH)})",
                  file=sys.stderr)
            return 2
        try:
            module.LAUNCH[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            module.LAUNCH[key] = value
    from fasttrain.cli import main as fasttrain

    return fasttrain(argv[cut + 1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
