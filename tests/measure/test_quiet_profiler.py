"""The probe's profile prints nothing of its own on stderr, and keeps what others print."""
import os

import torch

from fasttrain.measure.quiet_profiler import drop_kineto_lines, quiet_profile


def test_kineto_lines_are_dropped_and_others_kept():
    text = (b"USDT:2026-11-27 06:55:39 27086:27086 SyncActivityProfilerHandler.cpp:52] "
            b"profiler_start\nsomething else\nSTAGE:2026-11-27 06:55:50 27098:27098 "
            b"SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\nUSDT: not kineto\n")
    assert drop_kineto_lines(text) == b"something else\nUSDT: not kineto\n"


def test_a_quiet_profile_profiles_and_says_nothing(capfd):
    with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(3).add(1)
        os.write(2, b"the user's own line\n")  # printed while profiling: goes out as it is
    assert any(e.name == "aten::add" for e in prof.events())
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert err.count("the user's own line") == 1
