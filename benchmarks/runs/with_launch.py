"""Run a fasttrain command with launch settings of a kernel module changed, for A/B runs of a
setting that is not a recipe switch (a tile size, warps, programs per SM):

    python3 benchmarks/runs/with_launch.py window_attention programs_per_sm=4 -- train swin --recipe F.toml

sets ``fasttrain.kernels.window_attention.LAUNCH["programs_per_sm"] = 4`` (values are parsed
as Python literals where they are one: ints, floats, booleans; ``OTHER.KEY=VALUE`` sets a key of
``fasttrain.kernels.OTHER`` instead, for settings of two modules at once) and then runs ``fasttrain train
swin --recipe F.toml`` in the same process. The row it prints is the command's own; say which
setting it ran with where you keep it. AOTAutograd's cache is off in that process (see
``_no_aot_autograd_cache``), so the model is traced afresh with the settings.
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
    for setting in argv[1:cut]:
        key, _, value = setting.partition("=")
        name, _, key = key.rpartition(".")
        name = name or argv[0]
        module = importlib.import_module(f"fasttrain.kernels.{name}")
        if key not in module.LAUNCH:
            print(f"{name}.LAUNCH has no {key!r} (has {', '.join(module.LAUNCH)})",
                  file=sys.stderr)
            return 2
        try:
            module.LAUNCH[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            module.LAUNCH[key] = value
    from fasttrain.cli import build_parser, main as fasttrain

    args = build_parser().parse_args(argv[cut + 1:])
    if args.command not in ("train", "profile") or args.nproc > 1 or args.nnodes > 1:
        print("with_launch.py runs `fasttrain train` or `fasttrain profile` in one process: "
              "ladder rungs and torchrun ranks are fresh processes that would not see the "
              "settings", file=sys.stderr)
        return 2
    from fasttrain.errors import FasttrainError
    from fasttrain.recipe import Recipe, load_toml, parse_sets

    try:
        recipe = (load_toml(args.recipe) if args.recipe else Recipe()).replace(
            **parse_sets(args.set))
    except FasttrainError:
        recipe = Recipe()  # fasttrain itself reports the mistake, in one line
    if recipe.compile_cache:
        print("warning: compile_cache's artifacts do not depend on LAUNCH settings; a cache "
              "written with other settings would run them", file=sys.stderr)
    _no_aot_autograd_cache()
    return fasttrain(argv[cut + 1:])


def _no_aot_autograd_cache() -> None:
    """Turn off AOTAutograd's on-disk cache. Its key holds the graph's op calls and the source
    of a triton_op's kernels, not the LAUNCH values the op's Python body reads when Inductor
    traces it, and a hit skips Inductor altogether: a graph compiled earlier with other
    settings would run those settings (a first A/B of bias + GELU's settings did: 5.8 s of
    warm-up where a compile takes 60). Inductor's FX graph cache may stay on: its key holds
    each kernel call's constant arguments, launch configs and grid, so other settings miss it."""
    import torch._functorch.config as functorch_config

    functorch_config.enable_autograd_cache = False


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
