"""The presets shipped in the package (``src/fasttrain/presets/``): each one's recipe is the
measured preset file it was copied from, its rows exist and hold the ratio it claims, and
``--preset NAME`` / ``--preset fast`` / ``fasttrain presets`` behave, with one-line refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fasttrain.cli import main
from fasttrain.errors import FasttrainError
from fasttrain.presets import presets, resolve
from fasttrain.recipe import load_toml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(presets()))
def test_a_shipped_preset_is_its_measured_source(name):
    """The shipped recipe equals benchmarks/results/presets/<source>.toml, and its rows file has
    the ratio row it quotes: steady and equal to 3 decimals; where it quotes none, its ratio row
    is not steady, or there is none (each side measured once, without the confirmation)."""
    p = presets()[name]
    assert load_toml(p.path) == load_toml(ROOT / "benchmarks/results/presets" / f"{p.source}.toml")
    rows = [json.loads(line) for line in (ROOT / p.rows).read_text().splitlines()]
    ratio = next((r for r in rows if r["kind"] == "ratio"), None)
    assert all(r["workload"] == p.workload for r in rows)
    if p.ratio is None:
        assert ratio is None or not ratio["steady"]
    else:
        assert ratio is not None, f"{p.rows} has no ratio row"
        assert ratio["steady"] and round(ratio["ratio"], 3) == p.ratio


def test_fast_picks_the_best_measured_preset_on_a_hopper_gpu():
    """fast: the highest confirmed ratio for the workload and size (fp8 for hf:llama), on an H100
    or H200 only; nothing measured, another GPU, a CPU, an unknown or another workload's preset
    are one-line errors."""
    assert resolve("fast", "vit", "base", "NVIDIA H200").name == "vit-base"
    assert resolve("fast", "hf:llama", "base", "NVIDIA H100 80GB HBM3").name == "hf-llama-base-fp8"
    assert resolve("timm-vit-base", "timm:vit_base_patch16_224", "tiny", None).name == \
        "timm-vit-base"
    cases = [("fast", "vit", "base", None, "not on a CPU"),
             ("fast", "vit", "base", "NVIDIA A100-SXM4-80GB", "not on NVIDIA A100"),
             ("fast", "vit", "tiny", "NVIDIA H200", "no measured preset for vit tiny"),
             ("fast", "timm:swin_base_patch4_window7_224", "base", "NVIDIA H200",
              "no measured preset"),
             ("nope", "vit", "base", None, "no preset 'nope'"),
             ("vit-base", "swin", "base", None, "measured on vit, not swin")]
    for name, workload, size, gpu, says in cases:
        with pytest.raises(FasttrainError, match=says) as err:
            resolve(name, workload, size, gpu)
        assert "\n" not in str(err.value)


def test_presets_command_and_preset_option(capsys):
    """`fasttrain presets` lists every preset with its ratio; --preset with --recipe, or fast on
    a CPU, exits 2 with one line."""
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in presets()) and "1.270x" in out
    assert main(["ladder", "vit", "--preset", "vit-base", "--recipe", "x.toml"]) == 2
    assert capsys.readouterr().err.strip() == "fasttrain: error: give --preset or --recipe, not both"
    assert main(["train", "vit", "--device", "cpu", "--preset", "fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fasttrain: error: --preset fast") and "\n" not in err
