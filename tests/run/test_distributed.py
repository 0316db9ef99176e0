"""Data parallelism under torchrun with gloo on CPU: parity per sharding mode, DCP checkpoints
across world sizes, and a hung rank that fails the run by name in bounded time."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DT = 10  # dist_timeout of the hang tests: also the start-up barrier's, so not too tight for a loaded CI


def _env():
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}


def _train(*args, nproc=1, timeout=300):
    cmd = [sys.executable, "-m", "fasttrain", "train", "--device", "cpu", "--warmup", "0",
           "--json", *args]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=timeout)
    return proc


def _losses(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["losses"]


def test_train_prints_one_row_with_its_environment():
    proc = _train("llama", "--steps", "1", "--set", "batch=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout)
    assert (row["kind"], row["workload"], row["env"]["torch"]) == ("train", "llama",
                                                                   torch.__version__)


@pytest.fixture(scope="module")
def single():
    return _losses(_train("llama", "--steps", "3", "--set", "batch=8"))


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2", "zero3"])
def test_two_processes_match_one_on_the_same_global_batch(single, mode):
    """(accumulation with no_sync is covered by the next test)"""
    losses = _losses(_train("llama", "--steps", "3", "--set", "batch=8", "--set",
                            f"sharding={mode}", nproc=2))
    assert losses[0] == pytest.approx(single[0], rel=1e-6)  # step 1: no update yet
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), rtol=1e-5, atol=0)


def test_sd_under_fsdp2_matches_one_process():
    """SD's UNet under zero3: its stages are sharded, so the UNet's stacked time and text
    projections (computed before any stage's forward gathers its weights) go back to the blocks,
    and two processes train as one does."""
    args = ("sd", "--steps", "2", "--set", "batch=4")
    single = _losses(_train(*args))
    losses = _losses(_train(*args, "--set", "sharding=zero3", nproc=2))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", ["ddp", "zero2"])
def test_accumulation_reduces_once_and_still_matches_one_process(mode):
    one = _losses(_train("llama", "--steps", "3", "--set", "batch=8", "--set", "accumulation=2"))
    two = _losses(_train("llama", "--steps", "3", "--set", "batch=8", "--set", "accumulation=2",
                         "--set", f"sharding={mode}", nproc=2))
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=0)


def test_checkpoint_round_trip_across_world_sizes_and_export(tmp_path, single):
    straight = _losses(_train("llama", "--steps", "6", "--set", "batch=8"))
    ckpt, out = tmp_path / "ckpt", tmp_path / "model.pt"
    first = _losses(_train("llama", "--steps", "3", "--set", "batch=8", "--set",
                           "sharding=zero3", "--save", str(ckpt), "--save-every", "2", nproc=2))
    assert sorted(p.name for p in ckpt.iterdir()) == ["fasttrain.json", "step-000002",
                                                     "step-000003"]
    middle = _losses(_train("llama", "--steps", "4", "--set", "batch=8", "--resume",
                            str(ckpt / "step-000002")))  # the periodic save, 2 ranks' shards
    torch.testing.assert_close(torch.tensor(middle), torch.tensor(straight[2:]), rtol=1e-5,
                               atol=0)
    second = _losses(_train("llama", "--steps", "3", "--set", "batch=8", "--resume", str(ckpt),
                            "--save", str(tmp_path / "ckpt2"), "--export", str(out)))
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight),
                               rtol=1e-5, atol=0)
    full = torch.load(out, weights_only=False)
    weights = full["model"]
    assert "embed_tokens.weight" in weights and weights["embed_tokens.weight"].shape == (512, 64)


def test_zero1_checkpoints_resume_each_ranks_optimizer_partition(tmp_path):
    """zero1 keeps 1/N of the AdamW state per rank; saved by parameter name, every rank reads
    back its own partition, and the resumed run continues the straight one."""
    zero1 = ["--set", "batch=8", "--set", "sharding=zero1"]
    straight = _losses(_train("llama", "--steps", "6", *zero1, nproc=2))
    ckpt = tmp_path / "ckpt"
    first = _losses(_train("llama", "--steps", "3", *zero1, "--save", str(ckpt), nproc=2))
    second = _losses(_train("llama", "--steps", "3", *zero1, "--resume", str(ckpt), nproc=2))
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight),
                               rtol=1e-5, atol=0)
    alone = _train("llama", "--steps", "1", "--set", "batch=8", "--resume", str(ckpt))
    assert alone.returncode == 2 and "optimizer state is sharded by zero1" in alone.stderr, alone.stderr[-500:]


def test_a_hung_rank_fails_the_run_by_name_within_the_timeout():
    t0 = time.time()
    proc = _train("tests.helpers:hang_on_rank1", "--steps", "1", "--set",
                  f"dist_timeout={DT}", nproc=2, timeout=240)
    assert proc.returncode != 0 and time.time() - t0 < 200
    assert "rank 0: model built" in proc.stderr and "Ranks 1 failed to pass" in proc.stderr


def test_a_rank_hung_inside_a_step_is_named_within_the_timeout():
    """The waiting rank's collective times out after dist_timeout; the line names rank 1 (which
    never reached the all-reduce), not the rank that waited, and the hung rank is ended."""
    t0 = time.time()
    proc = _train("tests.helpers:hang_in_step3_on_rank1", "--steps", "6",
                  "--set", f"dist_timeout={DT}", nproc=2, timeout=240)
    took = time.time() - t0
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "rank 1 hung: never reached the collectives of step " in proc.stderr, proc.stderr[-2000:]
    assert "ranks 0 waited" in proc.stderr and "Traceback" not in proc.stderr
    assert took < 90 + DT, took  # start-up + DT + GRACE_S, not DT + torchrun's 30 s grace


def test_a_rank_hung_while_the_others_host_is_blocked_is_named_by_the_watchdog():
    """Rank 0 launched a collective rank 1 never joined and then blocked its host outside any
    collective (fp16's overflow read on a GPU): the step watchdog names rank 1 after
    dist_timeout + STALLED_AFTER_S and its reads, where NCCL's own timeout would have ended the
    job unnamed (and here nothing would: the run would sleep until the test's limit)."""
    from fasttrain.distributed.env import GRACE_S
    from fasttrain.distributed.watchdog import STALLED_AFTER_S

    t0 = time.time()
    proc = _train("tests.helpers:hang_with_the_host_blocked_on_rank0", "--steps", "6",
                  "--set", f"dist_timeout={DT}", nproc=2, timeout=240)
    took = time.time() - t0
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "fasttrain: error: rank 1 hung: never reached the collectives of step " in \
        proc.stderr, proc.stderr[-2000:]
    assert "ranks 0 waited" in proc.stderr and "Traceback" not in proc.stderr
    # start-up + the step's wait + two reads a look, and a second look where the first came
    # before the other rank had posted
    assert took < 90 + 2 * DT + STALLED_AFTER_S + 4 * GRACE_S, took


def test_the_watchdog_names_only_ranks_that_stayed_behind():
    """The lowest-numbered rank at the highest count of launched collectives names the ranks
    below it whose counts did not move between two reads; nobody else says anything."""
    from fasttrain.distributed.watchdog import verdict

    assert verdict(0, {0: 7, 1: 6}, {0: 7, 1: 6}) == [1]
    assert verdict(1, {0: 7, 1: 6}, {0: 7, 1: 6}) == []  # the rank behind
    assert verdict(0, {0: 7, 1: 7}, {0: 7, 1: 7}) == []  # level: a long step, not a hang
    assert verdict(0, {0: 7, 1: 5}, {0: 7, 1: 6}) == []  # rank 1 still launching: only late
    assert verdict(0, {0: 7}, {0: 7, 1: 6}) == []  # rank 1 posted once: not yet two reads
    three = ({0: 7, 1: 6, 2: 7}, {0: 7, 1: 6, 2: 7})
    assert verdict(0, *three) == [1] and verdict(2, *three) == []  # one line, from rank 0
    assert verdict(1, {}, {}) == [] and verdict(0, {0: 7}, {1: 6}) == []


def test_ladder_rungs_under_torchrun_and_the_scaling_report(tmp_path, monkeypatch):
    proc = subprocess.run([sys.executable, "-m", "fasttrain", "ladder", "llama", "--device", "cpu",
                           "--rungs", "fp32,fused-optim", "--nproc", "2", "--steps", "2",
                           "--warmup", "1", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=_env(), cwd=ROOT, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for f in tmp_path.glob("ladder-*.jsonl") for x in f.read_text().splitlines()]
    assert [(r["world_size"], r["batch"]) for r in rows] == [(2, 4), (2, 4)]
    assert all(r["parity"]["passed"] and "DDP over 2 ranks" in r["applied"]["sharding"] for r in rows)
    from fasttrain.ladder.scaling import run_scaling
    from fasttrain.recipe import Recipe

    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    rows = run_scaling("llama", "tiny", Recipe(), [1, 2], ["ddp", "zero2"], 2, "cpu", steps=2,
                       warmup=1)
    assert [(r["world_size"], r["sharding"]) for r in rows] == [(1, "none"), (2, "ddp"),
                                                                  (2, "zero2")]
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] > 0
    assert rows[1]["total_throughput"] == pytest.approx(2 * rows[1]["throughput"])
    assert "parity" not in rows[1]  # the world's reference
    assert rows[2]["parity"]["passed"] and rows[2]["parity"]["against"] == "w2-ddp"


def test_one_launch_optimizer_under_ddp_and_its_fallback_under_fsdp2(single):
    """optimizer_impl=triton (interpreted on the CPU) over DDP's gradients, which are views
    into its buckets, matches one process; FSDP2's sharded weights fall back to PyTorch's
    AdamW and say so."""
    ddp = _train("llama", "--steps", "3", "--set", "batch=8", "--set", "sharding=ddp",
                 "--set", "optimizer_impl=triton", nproc=2)
    torch.testing.assert_close(torch.tensor(_losses(ddp)), torch.tensor(single), rtol=1e-5,
                               atol=0)
    assert "one Triton launch" in json.loads(ddp.stdout)["applied"]["optimizer"]
    fsdp = _train("llama", "--steps", "3", "--set", "batch=8", "--set", "sharding=zero3",
                  "--set", "optimizer_impl=triton", nproc=2)
    torch.testing.assert_close(torch.tensor(_losses(fsdp)), torch.tensor(single), rtol=1e-5,
                               atol=0)
    row = json.loads(fsdp.stdout)
    assert "triton could not run" in row["applied"]["optimizer"]
    assert any("DTensors (sharded), not plain tensors; using PyTorch's fused AdamW" in w
               for w in row["warnings"])


def test_sigterm_under_torchrun_saves_on_every_rank_and_exits_143(tmp_path):
    """The launcher forwards SIGTERM to torchrun, which passes it on; the ranks agree on the
    step boundary, save together and stop."""
    import signal

    from fasttrain.run.checkpoint import resolve

    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "fasttrain", "train", "llama", "--device",
                             "cpu", "--steps", "100000", "--warmup", "0", "--set", "batch=8",
                             "--nproc", "2", "--save", str(ckpt), "--save-every", "2", "--out",
                             str(tmp_path / "o")], env=_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300  # start-up on a loaded 2-core CI machine
        # any periodic save: with --keep 2, step-000002 can come and go between two polls
        while not sorted(ckpt.glob("step-*")) and proc.poll() is None:
            assert time.time() < deadline, "no periodic save"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    line = next(x for x in err.splitlines() if "stopped after" in x)
    assert line.startswith("fasttrain: SIGTERM") and str(resolve(ckpt)) in line, line
