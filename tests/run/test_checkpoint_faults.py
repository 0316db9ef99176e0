"""Checkpoints survive faults: a save killed at any point over an existing checkpoint leaves the
last complete one (or a one-line refusal), never a mix; periodic saves keep the newest K and
resume exactly; SIGTERM/SIGINT save after the step under way and exit 143/130; an old-style
folder (one save written in place) still resumes."""
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.run import checkpoint, loop
from fasttrain.run.checkpoint import export, model_weights, resolve
from fasttrain.run.loop import train
from fasttrain.workloads import load_workload

ROOT = Path(__file__).resolve().parents[2]
# what a kill can land between: opening, writing, syncing, closing, renaming, deleting files
_IO = {"open", "write", "fsync", "close", "rename", "replace", "mkdir", "unlink", "rmdir",
       "rmtree", "touch", "write_bytes", "write_text"}


def _state():
    state, _, _ = loop.prepare(load_workload("vit", "tiny"), Recipe(), torch.device("cpu"))
    return state


def _save_killed_at(state, folder, step, k) -> int:
    """Save in a forked child that os._exit(9)s at its k-th file operation (k=0: never);
    returns the child's exit status, or the number of operations when k=0."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: count I/O calls made from Python, die at the k-th
        os.close(r)
        count = [0]

        def hook(frame, event, arg):
            if event == "c_call" and getattr(arg, "__name__", "") in _IO and \
                    not isinstance(getattr(arg, "__self__", None), str):  # not str.replace
                count[0] += 1
                if count[0] == k:
                    os._exit(9)
        sys.setprofile(hook)
        try:
            checkpoint.save(state, folder, step, keep=1)
        finally:
            sys.setprofile(None)
            os.write(w, str(count[0]).encode())
            os._exit(0)
    os.close(w)
    out = os.read(r, 64)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return int(out) if k == 0 else os.waitstatus_to_exitcode(status)


def _weights(state):
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def _resume_or_refusal(reader, folder) -> int | None:
    """What ``--resume`` makes of ``folder`` after a kill: the step of the last complete
    checkpoint, loaded into ``reader``; or None where nothing complete is there, after checking
    that resolving and loading both refuse in one line."""
    try:
        resolve(folder)
    except FasttrainError as err:  # nothing complete: a one-line refusal
        assert "\n" not in str(err), err
        with pytest.raises(FasttrainError, match="no complete checkpoint|no fasttrain") as again:
            checkpoint.load(reader, folder)
        assert "\n" not in str(again.value)
        return None
    return checkpoint.load(reader, folder)


def test_a_save_killed_anywhere_leaves_the_last_complete_checkpoint(tmp_path):
    state, reader = _state(), _state()
    base = tmp_path / "base"
    checkpoint.save(state, base, 2, keep=1)  # the existing checkpoint, step 2
    old = _weights(state)
    with torch.no_grad():  # the new save's weights and optimizer state differ from the old
        for p in state.model.parameters():
            p.add_(1.0)
        for s in state.optimizer.state.values():
            for t in s.values():
                if t.dim():
                    t.add_(1.0)
    new = _weights(state)
    shutil.copytree(base, tmp_path / "dry")
    ops = _save_killed_at(state, tmp_path / "dry", 4, 0)
    assert ops > 10 and resolve(tmp_path / "dry").name == "step-000004"
    rng, seen = random.Random(0), set()
    for trial in range(24):
        # every third kill lands in the last 40 operations: publishing and pruning
        folder, step = tmp_path / f"t{trial}", (4, 2)[trial % 2]
        k = rng.randint(1, ops) if trial % 3 else rng.randint(ops - 40, ops)
        if trial < 21:  # over an existing checkpoint (the same step or a later one)
            shutil.copytree(base, folder)
        else:  # into an empty folder, killed in the first half (before publishing)
            k = rng.randint(1, ops // 2)
        assert _save_killed_at(state, folder, step, k) == 9, k
        saved = _resume_or_refusal(reader, folder)
        if saved is None:
            assert trial >= 21, k
            seen.add("refused")
            continue
        got = resolve(folder)
        weights = _weights(reader)
        want = old if all(torch.equal(weights[n], old[n]) for n in old) else new
        assert all(torch.equal(weights[n], want[n]) for n in want), f"mixed state at {k}"
        assert saved == (2 if want is old else step), (k, got)
        full = torch.load(export(folder, tmp_path / "m.pt"), weights_only=True)["optim"]
        saved_avg = sum(float(v["exp_avg"].sum()) for v in full["state"].values())
        new_avg = sum(float(s["exp_avg"].sum()) for s in state.optimizer.state.values())
        assert (abs(saved_avg - new_avg) < 1e-3 * abs(new_avg)) == (want is new), \
            f"the optimizer state of one save, the weights of another (kill at {k})"
        seen.add("old" if want is old else "new")
    assert seen >= {"old", "new", "refused"}, seen  # kills landed before and after publishing
    state.restore.close()
    reader.restore.close()


def _env():
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
            "OMP_NUM_THREADS": "1"}


def _train_2proc(folder, steps, *extra, **popen) -> subprocess.Popen:
    """``fasttrain train llama --nproc 2 --save FOLDER`` (gloo on CPU, under torchrun), in a
    session of its own: its process group is the launcher and torchrun."""
    cmd = [sys.executable, "-m", "fasttrain", "train", "llama", "--size", "tiny", "--device",
           "cpu", "--warmup", "0", "--set", "batch=8", "--nproc", "2", "--steps", str(steps),
           "--save", str(folder), "--out", str(folder.parent / "rows"), *extra]
    return subprocess.Popen(cmd, env=_env(), cwd=ROOT, start_new_session=True, **popen)


def _tree(pid: int) -> set[int]:
    """``pid`` and every process below it (psutil where installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # the fields after ")": state, ppid
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1]
                                               .split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, grew = {pid}, True
    while grew:
        below = {p for p, pp in parents.items() if pp in found}
        grew, found = not below <= found, found | below
    return found


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie waiting to be reaped is not)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            out.add(pid)
    return out


def _kill_when_saving(proc, folder, delay: float, ranks_too: bool) -> set[int]:
    """Once a save of this run is under way (its temporary step folder is there), wait
    ``delay`` s and SIGKILL the run's process group (the launcher and torchrun; the ranks,
    in sessions of their own, follow their parent), and with ``ranks_too`` every rank at the
    same moment (as a node failure would: saves torn in the middle). Returns the tree's
    processes."""
    deadline = time.time() + 300  # start-up of launcher, torchrun and 2 ranks on a loaded CI
    while not any(p.name.endswith(".tmp") for p in (folder.iterdir() if folder.is_dir()
                                                    else ())):
        assert proc.poll() is None, "the run ended before its first save"
        assert time.time() < deadline, "no save began"
        time.sleep(0.01)
    time.sleep(delay)
    pids = _tree(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids - {proc.pid} if ranks_too else ():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return pids


@pytest.mark.slow
def test_a_two_process_run_killed_while_saving_resumes_or_refuses(tmp_path):
    """A SIGKILL of ``train --nproc 2``'s process group (launcher and torchrun; the ranks follow
    their parent), or of every process of it at once, at a random moment inside its saves, over
    an existing checkpoint and into an empty folder: nothing of the run is left running, and
    resuming continues the last complete checkpoint's losses or refuses in one line."""
    wl, recipe = load_workload("llama", "tiny"), Recipe(batch=8)
    ref = tmp_path / "ref"  # the losses of an unbroken run, and its step-2 checkpoint
    done = _train_2proc(ref, 34, "--save-every", "2", "--keep", "1000", "--json",
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-2000:]
    straight = json.loads(out)["losses"]
    reader, rng, seen = loop.prepare(wl, recipe, torch.device("cpu"))[0], random.Random(0), []
    for trial in range(5):
        folder = tmp_path / f"t{trial}"
        resume = []
        if trial < 4:  # over an existing checkpoint: continue step 2's, saving every step
            shutil.copytree(ref / "step-000002", folder / "step-000002")
            resume = ["--resume", str(folder)]
        proc = _train_2proc(folder, 30, "--save-every", "1", *resume,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pids = _kill_when_saving(proc, folder, rng.uniform(0.0, 1.5) if trial < 4 else
                                 rng.uniform(0.0, 0.05), ranks_too=trial % 2 == 0)
        deadline = time.time() + 30
        while _alive(pids) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(pids), f"trial {trial}: left running: {sorted(_alive(pids))}"
        saved = _resume_or_refusal(reader, folder)
        seen.append(saved)
        if saved is None:
            assert trial == 4, f"trial {trial}: step 2's checkpoint was lost"
            continue
        assert saved >= (2 if trial < 4 else 1), (trial, saved)
        losses = train(wl, recipe, steps=2, warmup=0, resume_from=str(folder)).losses
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(straight[saved:saved + 2]),
                                   rtol=1e-5, atol=0, msg=f"trial {trial}: resumed at {saved}")
    assert any(s is not None and 2 < s < 32 for s in seen), seen  # killed mid-run
    reader.restore.close()


def test_periodic_saves_keep_the_newest_k_and_resume_from_the_middle(tmp_path):
    wl, recipe = load_workload("llama", "tiny"), Recipe(batch=8, accumulation=2)
    ckpt = tmp_path / "c"
    straight = train(wl, recipe, steps=8, warmup=0).losses
    saved = train(wl, recipe, steps=5, warmup=2, save_to=str(ckpt), save_every=2, keep=3).losses
    torch.testing.assert_close(torch.tensor(saved), torch.tensor(straight[:7]), rtol=1e-6,
                               atol=0)  # saving inside the loop changes nothing
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["fasttrain.json", "step-000004", "step-000006", "step-000007"], names
    middle = train(wl, recipe, steps=3, warmup=0, resume_from=str(ckpt / "step-000004")).losses
    torch.testing.assert_close(torch.tensor(middle), torch.tensor(straight[4:7]), rtol=1e-6,
                               atol=0)
    last = train(wl, recipe, steps=1, warmup=0, resume_from=str(ckpt)).losses  # picks 7
    torch.testing.assert_close(torch.tensor(last), torch.tensor(straight[7:]), rtol=1e-6, atol=0)


def test_torn_and_cut_off_saves_are_passed_over_or_refused_in_one_line(tmp_path):
    wl, ckpt = load_workload("vit", "tiny"), tmp_path / "c"
    train(wl, Recipe(), steps=2, warmup=0, save_to=str(ckpt), save_every=1)
    assert resolve(ckpt).name == "step-000002"
    data = next((ckpt / "step-000002").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # torn: the older complete one is used
    assert resolve(ckpt).name == "step-000001"
    (ckpt / "step-000001" / ".complete").unlink()  # unmarked: passed over too
    with pytest.raises(FasttrainError, match="no complete checkpoint") as err:
        train(wl, Recipe(), steps=1, warmup=0, resume_from=str(ckpt))
    assert "\n" not in str(err.value)
    with pytest.raises(FasttrainError, match="cut off before it finished"):
        resolve(ckpt / "step-000001")
    only_temp = tmp_path / "d"
    (only_temp / ".step-000003.tmp").mkdir(parents=True)
    with pytest.raises(FasttrainError, match="no complete checkpoint in .*cut off"):
        export(only_temp, tmp_path / "m.pt")


def test_an_old_style_folder_still_resumes_exports_and_serves(tmp_path):
    wl, recipe = load_workload("vit", "tiny"), Recipe()
    straight = train(wl, recipe, steps=3, warmup=0).losses
    train(wl, recipe, steps=2, warmup=0, save_to=str(tmp_path / "new"))
    old = tmp_path / "old"  # the layout of earlier versions: one save's files at the top
    shutil.copytree(tmp_path / "new" / "step-000002", old)
    (old / ".complete").unlink()
    assert resolve(old) == old
    res = train(wl, recipe, steps=1, warmup=0, resume_from=str(old))
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(straight[2:]), rtol=1e-6,
                               atol=0)
    assert "head.weight" in model_weights(old, wl)
    assert "optim" in torch.load(export(old, tmp_path / "m.pt"), weights_only=True)
    record = (old / "fasttrain.json").read_text()
    train(wl, recipe, steps=1, warmup=0, resume_from=str(old), save_to=str(old))
    assert resolve(old).name == "step-000003"  # a new save goes beside it, into a step folder
    assert (old / "fasttrain.json").read_text() == record  # the old save is left whole


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_after_the_step_and_exits(tmp_path, signum, code):
    ckpt = tmp_path / "c"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fasttrain", "train", "vit", "--size", "tiny",
                             "--device", "cpu", "--steps", "100000", "--warmup", "0", "--set",
                             "batch=2", "--save", str(ckpt), "--save-every", "2", "--out",
                             str(tmp_path / "o")], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300  # a hang guard: a loaded 2-core CI machine once took > 120 s
        # Any periodic save will do: with --keep 2 on a fast machine step-000002 is deleted again
        # within ~0.1 s, so waiting for that one folder can miss it.
        while not (seen := sorted(ckpt.glob("step-*"))) and proc.poll() is None:
            assert time.time() < deadline, "no periodic save"
            time.sleep(0.05)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert signal.Signals(signum).name in line and "saved" in line, line
    folder = resolve(ckpt)
    assert seen and str(folder) in line and folder.name > seen[-1].name


@pytest.mark.parametrize("extra,needle", [
    (["--save-every", "2"], "--save-every saves into the folder of --save"),
    (["--save", "c", "--keep", "0"], "--keep must be 1 or more (the newest step folders kept), not 0"),
    (["--save", "c", "--save-every", "-1"], "--save-every must be 0 or more (0: only at the end), not -1"),
])
def test_bad_save_options_are_one_line(capsys, tmp_path, extra, needle):
    from fasttrain.cli import main

    extra = [str(tmp_path / x) if x == "c" else x for x in extra]
    assert main(["train", "vit", "--size", "tiny", "--device", "cpu", "--steps", "1", "--warmup",
                 "0", "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err
    assert not (tmp_path / "c").exists()


def test_resume_compares_the_batch_and_lr_the_run_really_used(tmp_path, capsys):
    """A save of the workload's own batch records that batch (not the recipe's 0, "the
    workload's"), so resuming with that batch given explicitly is accepted; another batch is
    refused in one line naming the way out."""
    from fasttrain.cli import main

    ckpt, out = tmp_path / "c", str(tmp_path / "o")
    common = ["train", "vit", "--size", "tiny", "--device", "cpu", "--warmup", "0", "--out", out]
    assert main([*common, "--steps", "1", "--save", str(ckpt)]) == 0
    wl = load_workload("vit", "tiny")
    record = json.loads((resolve(ckpt) / "fasttrain.json").read_text())["recipe"]
    assert record["batch"] == wl.default_batch and record["lr"] == wl.reference_lr
    assert main([*common, "--steps", "1", "--resume", str(ckpt), "--batch",
                 str(wl.default_batch)]) == 0
    capsys.readouterr()
    assert main([*common, "--steps", "1", "--resume", str(ckpt), "--batch",
                 str(wl.default_batch * 2)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"resume with --set batch={wl.default_batch}" in err, err


def test_the_train_row_and_summary_say_what_was_resumed_and_saved(tmp_path, capsys):
    from fasttrain.cli import main

    ckpt, out = tmp_path / "c", tmp_path / "o"
    common = ["train", "vit", "--size", "tiny", "--device", "cpu", "--warmup", "0", "--out",
              str(out), "--save", str(ckpt), "--save-every", "1", "--keep", "2"]
    assert main([*common, "--steps", "3"]) == 0
    first = capsys.readouterr().out
    assert main([*common, "--steps", "1", "--resume", str(ckpt), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["checkpoint"] == {"resumed_from": str(ckpt / "step-000003"),
                                 "saved": str(ckpt / "step-000004"), "kept": 2,
                                 "exported": None}
    assert "checkpoint" in first and f"saved {ckpt / 'step-000003'}" in first.replace("\n", "")
