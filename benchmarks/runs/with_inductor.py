"""Run a fasttrain command with ``torch._inductor.config`` keys changed, for A/B runs of an
Inductor setting that is not (yet) a recipe switch:

    python3 benchmarks/runs/with_inductor.py triton.enable_pdl=True -- train swin --recipe F.toml

sets ``torch._inductor.config.triton.enable_pdl = True`` (values are Python literals) and then
runs ``fasttrain train swin --recipe F.toml`` in the same process, with AOTAutograd's on-disk
cache off (as ``with_launch.py``). The row it prints is the command's own; say which setting it
ran with where you keep it. Recipe switches made from such settings (``pdl``, ``combo_kernels``)
set them for their run only and say so in the row.
"""
from __future__ import annotations

import ast
import sys


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: with_inductor.py KEY=VALUE ... -- FASTTRAIN-ARGS", file=sys.stderr)
        return 2
    import torch._inductor.config as inductor_config

    cut = argv.index("--")
    for setting in argv[:cut]:
        key, _, value = setting.partition("=")
        *path, last = key.split(".")
        obj = inductor_config
        for part in path:
            obj = getattr(obj, part, None)
        if obj is None or not hasattr(obj, last):
            print(f"torch._inductor.config has no {key!r}", file=sys.stderr)
            return 2
        try:
            setattr(obj, last, ast.literal_eval(value))
        except (ValueError, SyntaxError):
            print(f"{key}: {value!r} is not a Python literal", file=sys.stderr)
            return 2
    from with_launch import _no_aot_autograd_cache  # benchmarks/runs/, the script's own folder

    from fasttrain.cli import main as fasttrain

    _no_aot_autograd_cache()
    return fasttrain(argv[cut + 1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
