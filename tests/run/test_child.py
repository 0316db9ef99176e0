"""One job in a fresh process: a typed spec in, a row out, whatever happens in the child."""
from pathlib import Path

import pytest

from fasttrain.run.child import ChildSpec, run_in_child, run_job

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}  # the child imports its job from tests.helpers


def _spec(job: str, **kw) -> ChildSpec:
    return ChildSpec(job=f"tests.helpers:{job}", workload="vit", **kw)


def test_the_spec_survives_the_trip_as_json():
    spec = _spec("child_job_row", steps=3, recipe={"precision": "bf16-mixed"},
                 options={"vocab": 50257}, budget_gib=2.5)
    assert ChildSpec.from_json(spec.to_json()) == spec


def test_a_child_writes_its_jobs_row(tmp_path):
    row = run_in_child(_spec("child_job_row", steps=3, recipe={"seed": 1}), tmp_path, "a",
                       extra_env=ENV)
    assert row == {"workload": "vit", "steps": 3, "recipe": {"seed": 1}, "error": None}
    assert {p.name for p in tmp_path.iterdir()} == {"a.spec.json", "a.row.json", "a.log"}


@pytest.mark.parametrize("job, error", [
    ("child_job_raises", "RuntimeError: boom in the child"),
    ("child_job_user_error", "batch 3 is not divisible by 2 processes"),
    ("no_such_job", "no_such_job"),
])
def test_a_failing_job_is_a_row_with_its_error(tmp_path, job, error):
    row = run_in_child(_spec(job), tmp_path, job, extra_env=ENV)
    assert error in row["error"]


def test_a_hung_child_is_stopped_and_says_so(tmp_path):
    row = run_in_child(_spec("child_job_hangs"), tmp_path, "hang", timeout=5, extra_env=ENV)
    assert row["error"] == "timed out after 5 s"


def test_a_job_name_without_a_function_is_refused():
    assert "package.module:function" in run_job(ChildSpec(job="tests.helpers",
                                                          workload="vit"))["error"]
    with pytest.raises(TypeError):
        ChildSpec(job="x:y")  # the workload is required
