"""benchmarks/runs/with_launch.py: it sets a kernel module's LAUNCH values and turns off
AOTAutograd's cache (whose key does not hold those values) before it runs the command."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.interpreted import kernels_interpreted  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "runs" / "with_launch.py"


def _script():
    spec = importlib.util.spec_from_file_location("with_launch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_with_launch_sets_the_values_and_turns_off_the_aot_autograd_cache(monkeypatch, capsys):
    import torch._functorch.config as functorch_config

    import fasttrain.cli

    with kernels_interpreted():
        from fasttrain.kernels import activations
    # config.patch restores the flag the script sets (monkeypatch's undo deletes a torch config
    # entry, which broke every later compile in the same process)
    with functorch_config.patch(enable_autograd_cache=True):
        for key in ("stages", "bwd_warps"):
            monkeypatch.setitem(activations.LAUNCH, key, activations.LAUNCH[key])
        seen = {}

        def fake_main(argv):
            seen.update(argv=argv, launch=dict(activations.LAUNCH),
                        cache=functorch_config.enable_autograd_cache)
            return 0

        monkeypatch.setattr(fasttrain.cli, "main", fake_main)
        argv = ["train", "vit", "--size", "tiny", "--steps", "2"]
        assert _script().main(["activations", "stages=1", "bwd_warps=8", "--", *argv]) == 0
        assert seen["argv"] == argv
        assert (seen["launch"]["stages"], seen["launch"]["bwd_warps"]) == (1, 8)
        assert seen["cache"] is False

        # a key the module does not have, and a command that would run in other processes
        assert _script().main(["activations", "nope=1", "--", *argv]) == 2
        assert "activations.LAUNCH has no 'nope'" in capsys.readouterr().err
        assert _script().main(["activations", "stages=1", "--", "ladder", "vit"]) == 2
