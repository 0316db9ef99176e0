"""Nothing lost on a full disk: a row file never gets a torn line, a rewritten file keeps its old
content, the CLI says in one line which file could not be written and how much room it needed
(exit status 1, no traceback), a finished row that cannot be saved is printed instead, and two
commands started in the same second never share a rows file.

A full disk is simulated without root: ``os.write`` (what ``append_line`` writes with) or the
``open`` of ``measure.files`` (what ``write_atomic`` writes with) let a few bytes through into
files under the test's folder, then raise ENOSPC (or EDQUOT), as Linux does."""
import argparse
import datetime
import errno
import json
import os
from pathlib import Path

import pytest

from fasttrain.cli import common
from fasttrain.cli import main
from fasttrain.errors import DiskFullError, disk_full
from fasttrain.measure import files
from fasttrain.measure.files import append_line, write_atomic, write_folder_atomic
from fasttrain.measure.rows import append_row, make_row

FAST = ["--size", "tiny", "--steps", "1", "--warmup", "0", "--device", "cpu"]
_WRITE = os.write


def _under(fd: int, root: Path) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
    except OSError:
        return False


@pytest.fixture
def full_disk(monkeypatch, tmp_path):
    """``full_disk(room, code)``: from now on, writes into files under ``tmp_path`` get ``room``
    more bytes, then fail with ``code`` (ENOSPC by default); other files are untouched."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to tell the test's files from others")

    def fill(room: int = 0, code: int = errno.ENOSPC):
        left = [room]

        def write(fd, data):
            if not _under(fd, tmp_path):
                return _WRITE(fd, data)
            if left[0] <= 0:
                raise OSError(code, os.strerror(code))
            n = _WRITE(fd, bytes(data[:left[0]]))  # a short write, as a filling disk gives
            left[0] -= n
            return n

        class Full:  # a file of ``open`` whose writes stop after ``room`` bytes
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def __getattr__(self, name):
                return getattr(self.f, name)

            def write(self, data):
                if len(data) > left[0]:
                    self.f.write(data[:max(left[0], 0)])
                    self.f.flush()
                    left[0] = 0
                    raise OSError(code, os.strerror(code))
                left[0] -= len(data)
                return self.f.write(data)

        real_open = open
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(files, "open", lambda *a, **k: Full(real_open(*a, **k)),
                            raising=False)
    return fill


# --- the writers ---

@pytest.mark.parametrize("room", [0, 5, 17])
def test_append_line_on_a_full_disk_leaves_no_torn_line(tmp_path, full_disk, room):
    path = tmp_path / "rows.jsonl"
    append_line(path, '{"a": 1}')
    append_line(path, '{"b": 2}')
    old = path.read_bytes()
    full_disk(room)
    line = json.dumps({"c": "x" * 40})
    with pytest.raises(DiskFullError) as err:
        append_line(path, line)
    assert path.read_bytes() == old  # cut back to the last whole line
    assert err.value.path == str(path) and err.value.needed == len(line) + 1
    assert str(err.value) == (f"the disk is full: cannot write {path} ({len(line) + 1} bytes "
                              "needed): free space or pass --out elsewhere")


def test_append_line_into_a_new_file_on_a_full_disk_leaves_it_empty(tmp_path, full_disk):
    full_disk(3)
    with pytest.raises(DiskFullError):
        append_line(tmp_path / "new.jsonl", "0123456789")
    assert (tmp_path / "new.jsonl").read_bytes() == b""


def test_a_full_quota_is_said_as_such(tmp_path, full_disk):
    full_disk(0, errno.EDQUOT)
    with pytest.raises(DiskFullError, match="^the disk quota is exceeded: cannot write .*rows"):
        append_line(tmp_path / "rows.jsonl", "x")


@pytest.mark.parametrize("data", ["new text " * 100, b"new bytes" * 100])
def test_write_atomic_on_a_full_disk_keeps_the_old_file(tmp_path, full_disk, data):
    path = tmp_path / "recipe.toml"
    write_atomic(path, "old")
    full_disk(10)
    with pytest.raises(DiskFullError, match=r"cannot write .*recipe\.toml \(900 bytes needed\)"):
        write_atomic(path, data)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.toml"]  # no temporary left


def test_write_atomic_of_a_new_file_on_a_full_disk_leaves_no_empty_file(tmp_path, full_disk):
    full_disk(0)
    with pytest.raises(DiskFullError):
        write_atomic(tmp_path / "suggested.toml", "[recipe]\n")
    assert not list(tmp_path.iterdir())  # never a 0-byte file


def test_a_writer_function_on_a_full_disk_says_the_free_space(tmp_path):
    def writer(tmp):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    with pytest.raises(DiskFullError, match=r"cannot write .*data\.bin \([0-9.]+ \w+ free "
                                            r"there\): free space or pass --out elsewhere"):
        write_atomic(tmp_path / "data.bin", writer)
    with pytest.raises(DiskFullError, match="cannot write .*images"):
        write_folder_atomic(tmp_path / "images", writer)
    assert not list(tmp_path.iterdir())


def test_a_torch_save_on_a_full_disk_is_said_as_such(tmp_path, full_disk):
    """torch's own file writer reports a full disk as "unexpected pos …"; through torch_save (the
    consolidated checkpoint, a fit trial's save) it is a DiskFullError naming the file, and
    nothing is left behind."""
    import torch

    from fasttrain.measure.files import torch_save

    full_disk(100)
    with pytest.raises(DiskFullError, match=r"^the disk is full: cannot write .*model\.pt"):
        write_atomic(tmp_path / "model.pt", lambda tmp: torch_save({"w": torch.zeros(4096)}, tmp))
    assert not list(tmp_path.iterdir())


def test_a_torch_save_keeps_what_torch_load_reads(tmp_path):
    import torch

    from fasttrain.measure.files import torch_save

    torch_save({"w": torch.arange(5.0)}, tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["w"], torch.arange(5.0))


def test_other_os_errors_stay_what_they_are(tmp_path):
    def writer(tmp):
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError, match="I/O error"):
        write_atomic(tmp_path / "x", writer)
    assert disk_full(OSError(errno.EACCES, "denied")) is None


def test_a_full_disk_in_an_exceptions_chain_is_found():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/shard.distcp")
        except OSError as inner:
            raise RuntimeError("the checkpoint save failed") from inner
    except RuntimeError as outer:
        found = disk_full(outer)
    assert found is not None and found.path == "/ckpt/shard.distcp"


# --- rows ---

def test_a_row_that_cannot_be_saved_is_printed(tmp_path, full_disk, capsys):
    path = tmp_path / "rows.jsonl"
    first = make_row("train", "vit", "tiny", step_time_s=0.5)
    append_row(path, first)
    full_disk(7)
    row = make_row("train", "vit", "tiny", step_time_s=0.25, losses=[1.0, float("nan")])
    with pytest.raises(DiskFullError):
        append_row(path, row)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"fasttrain: this row was not saved to {path} (the disk is full)")
    assert json.loads(out[1]) == {**row, "losses": [1.0, None]}
    assert [json.loads(x) for x in path.read_text().splitlines()] == [first]


# --- the command line ---

def _one_line_exit_1(capsys, argv, needle):
    rc = main(argv)
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert rc == 1, cap.err
    assert "Traceback" not in cap.err + cap.out
    assert len(lines) == 1 and needle in lines[0], cap.err
    assert lines[0].startswith("fasttrain: error: the disk is full: cannot write ")
    assert lines[0].endswith("needed): free space or pass --out elsewhere"), lines[0]
    return cap.out


def test_train_on_a_full_disk_is_one_line_and_prints_its_row(capsys, tmp_path, full_disk,
                                                             monkeypatch):
    from fasttrain.measure import rows

    real = rows.append_line

    def full_when_the_row_comes(path, line):
        full_disk(0)
        return real(path, line)

    monkeypatch.setattr(rows, "append_line", full_when_the_row_comes)
    out = _one_line_exit_1(capsys, ["train", "vit", *FAST, "--out", str(tmp_path)],
                           str(tmp_path / "train-vit-tiny-"))
    note, line = out.splitlines()[-2:]
    assert note.startswith("fasttrain: this row was not saved to ")
    row = json.loads(line)
    assert row["kind"] == "train" and row["workload"] == "vit" and row["step_time_s"] > 0
    assert not list(tmp_path.glob("*.jsonl"))  # the empty rows file is not left behind


def test_a_full_disk_outside_fasttrains_writers_is_one_line_too(capsys, tmp_path, monkeypatch):
    from fasttrain.run import loop

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt" / "0.distcp"))

    monkeypatch.setattr(loop, "train", full)
    rc = main(["train", "vit", *FAST, "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith(f"fasttrain: error: the disk is full: cannot write {tmp_path}/ckpt/"
                             "0.distcp (") and err[0].endswith("free space or pass --out "
                                                               "elsewhere")


def test_a_suggested_recipe_on_a_full_disk_leaves_no_empty_toml(capsys, tmp_path, full_disk,
                                                                monkeypatch):
    real = files.write_atomic

    def full_for_the_recipe(path, data):
        if Path(path).name == "suggested.toml":
            full_disk(0)
        return real(path, data)

    monkeypatch.setattr(files, "write_atomic", full_for_the_recipe)
    toml = tmp_path / "suggested.toml"
    _one_line_exit_1(capsys, ["profile", "vit", "--device", "cpu", "--steps", "2", "--warmup",
                              "0", "--active", "1", "--out", str(tmp_path / "out"),
                              "--suggest-recipe", str(toml)], f"cannot write {toml} (")
    assert not toml.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary file either
    (rows,) = (tmp_path / "out").glob("profile-vit-tiny-*/profile.jsonl")  # the row was saved
    assert rows.read_text().count("\n") == 1


# --- unique rows files ---

def test_two_commands_in_the_same_second_get_two_files(tmp_path, monkeypatch):
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 11, 26, 12, 0, 0)

    monkeypatch.setattr(common.datetime, "datetime", Frozen)
    args = argparse.Namespace(out=str(tmp_path), workload="tests.helpers:tiny")
    first, second, third = (common._out_path(args, "ladder", "tiny") for _ in range(3))
    assert first.name == "ladder-tests_helpers_tiny-tiny-20261126-120000.jsonl"
    assert second.name == "ladder-tests_helpers_tiny-tiny-20261126-120000-2.jsonl"
    assert third.name == "ladder-tests_helpers_tiny-tiny-20261126-120000-3.jsonl"
    folders = [common._out_path(args, "profile", "tiny", suffix="") for _ in range(2)]
    assert [f.name for f in folders] == ["profile-tests_helpers_tiny-tiny-20261126-120000",
                                         "profile-tests_helpers_tiny-tiny-20261126-120000-2"]
    assert all(f.is_dir() for f in folders)
    append_line(second, "{}")
    common._drop_unused_outputs()  # what the command made and left empty goes
    assert [p.name for p in tmp_path.iterdir()] == [second.name]
