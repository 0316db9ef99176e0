"""fasttrain.Step: a user's own loop keeps its shape, the step does what the plain loop does."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fasttrain
from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.run.step import DEFAULT, _difference, _signature

NO_COMPILE = {"compile": "none"}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 5))


def _batches(n: int = 4, rows: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g))
            for _ in range(n)]


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _plain(model, opt, batches, clip=1.0):
    out = []
    for b in batches:
        loss = _loss(model, b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def test_step_with_your_optimizer_trains_exactly_as_the_plain_loop():
    batches = _batches()
    ref, mine = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    expected = _plain(ref, ref_opt, batches)
    step = fasttrain.Step(mine, opt, _loss, batches[0], recipe=NO_COMPILE)
    got = [step(b).item() for b in batches]
    assert got == pytest.approx(expected, rel=1e-6)
    assert step.optimizer is opt
    for p, q in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(p, q)
    assert step.report()["applied"]["optimizer"].startswith("yours: AdamW")


def test_step_with_a_recipe_builds_the_optimizer_and_keeps_the_loss():
    batches = _batches()
    ref, mine = _model(), _model()
    expected = _plain(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01),
                      batches)
    step = fasttrain.Step(mine, {"lr": 3e-3, **NO_COMPILE}, _loss, batches[0])
    got = [step(b).item() for b in batches]
    assert got == pytest.approx(expected, rel=1e-5)
    assert isinstance(step.optimizer, torch.optim.AdamW)
    assert step.optimizer.param_groups[0]["lr"] == 3e-3


@pytest.mark.parametrize("shape", ["tensor", "tuple", "dict", "nested"])
def test_any_batch_structure_reaches_the_loss_as_given(shape):
    x, y = _batches(1)[0]
    batch = {"tensor": x, "tuple": (x, y), "dict": {"x": x, "y": y},
             "nested": {"inputs": [x], "y": y, "note": "kept"}}[shape]
    seen = []

    def loss_fn(model, b):
        seen.append(b)
        inputs = {"tensor": lambda: b, "tuple": lambda: b[0], "dict": lambda: b["x"],
                  "nested": lambda: b["inputs"][0]}[shape]()
        return model(inputs).square().mean()

    step = fasttrain.Step(_model(), {**NO_COMPILE}, loss_fn, batch)
    step(batch)
    last = seen[-1]
    assert type(last) is type(batch)
    if shape == "nested":
        assert last["note"] == "kept" and torch.equal(last["inputs"][0], x)


def test_step_on_a_cpu_says_which_gpu_switches_it_turned_off():
    step = fasttrain.Step(_model(), {}, _loss, _batches(1)[0], recipe=None)
    notes = " ".join(step.report()["notes"])
    if DEFAULT.cuda_graphs:
        assert "cuda_graphs" in notes and "precision" in notes
    assert step.report()["graphed"] is False
    assert "fasttrain.Step on cpu" in repr(step)


def test_step_compiled_on_cpu_matches_eager():
    batches = _batches(3)
    eager = fasttrain.Step(_model(), {"lr": 1e-2, **NO_COMPILE}, _loss, batches[0])
    torch._dynamo.reset()
    compiled = fasttrain.Step(_model(), {"lr": 1e-2, "compile": "model",
                                         "compile_backend": "aot_eager"}, _loss, batches[0])
    a = [eager(b).item() for b in batches]
    b = [compiled(b).item() for b in batches]
    assert b == pytest.approx(a, rel=1e-5)
    assert "compiled" in compiled.report()["applied"]["compile"]


def test_a_batch_signature_names_the_first_difference():
    a = _signature({"0": torch.zeros(4, 3)}, {})
    b = _signature({"0": torch.zeros(2, 3)}, {})
    c = _signature({"0": torch.zeros(4, 3, dtype=torch.float16)}, {})
    assert a != b and a != c
    assert _difference(a, b) == ("batch tensor 0 is (2, 3) torch.float32, the captured one "
                                 "(4, 3) torch.float32")
    assert "float16" in _difference(a, c)
    assert "non-tensor" in _difference(_signature({"0": torch.zeros(1)}, {1: 3}),
                                        _signature({"0": torch.zeros(1)}, {1: 4}))


def _bad(model=None, second=None, loss_fn=_loss, batch="default", **kw):
    model = _model() if model is None else model
    batch = _batches(1)[0] if isinstance(batch, str) else batch
    return fasttrain.Step(model, second if second is not None else {**NO_COMPILE}, loss_fn,
                          batch, **kw)


@pytest.mark.parametrize("case, match", [
    ("not a module", "model must be a torch.nn.Module"),
    ("no loss_fn", "pass loss_fn"),
    ("no example batch", "pass an example batch"),
    ("no tensor in the batch", "holds no tensor"),
    ("a non-scalar loss", r"shape \(6, 5\), not a scalar; reduce it"),
    ("a float loss", "returned float, not a tensor"),
    ("a detached loss", "does not require grad"),
    ("a second argument of another type", "not int"),
    ("an unknown preset", "no preset 'nope'"),
    ("accumulation", "accumulation is your loop's"),
    ("cosine without a length", "pass total_steps"),
    ("no parameters", "no parameters to train"),
    ("an unknown switch", "unknown switch 'speed'"),
])
def test_bad_input_is_one_line_naming_the_way_out(case, match):
    x, y = _batches(1)[0]
    calls = {
        "not a module": lambda: _bad(model=lambda z: z),
        "no loss_fn": lambda: _bad(loss_fn=None),
        "no example batch": lambda: _bad(batch=None),
        "no tensor in the batch": lambda: _bad(batch={"a": 1}),
        "a non-scalar loss": lambda: _bad(loss_fn=lambda m, b: m(b[0])),
        "a float loss": lambda: _bad(loss_fn=lambda m, b: _loss(m, b).item()),
        "a detached loss": lambda: _bad(loss_fn=lambda m, b: _loss(m, b).detach()),
        "a second argument of another type": lambda: _bad(second=3),
        "an unknown preset": lambda: _bad(second="nope"),
        "accumulation": lambda: _bad(second={"accumulation": 2}),
        "cosine without a length": lambda: _bad(second={
            "schedule": "cosine", "graph_memset_kernels": False, "cuda_graphs": False}),
        "no parameters": lambda: _bad(model=nn.ReLU()),
        "an unknown switch": lambda: _bad(second={"speed": "max"}),
    }
    with pytest.raises(FasttrainError, match=match) as err:
        calls[case]()
    assert "\n" not in str(err.value)


def test_a_preset_by_name_and_a_recipe_object_are_accepted():
    step = fasttrain.Step(_model(), Recipe(lr=1e-3), _loss, _batches(1)[0])
    assert step.recipe.lr == 1e-3
    from fasttrain.presets import presets

    for name in presets():  # every preset, on a CPU: its GPU switches off, and said so
        step = fasttrain.Step(_model(), name, _loss, _batches(1)[0])
        assert step.recipe.cuda_graphs is False and step.recipe.optimizer_state == "fp32"


def test_your_own_optimizer_turns_off_the_one_launch_adamw_s_switches():
    from fasttrain.run.step import _recipe

    recipe = Recipe(precision="bf16-mixed", optimizer_impl="triton", master_weights=True,
                    optimizer_state="bf16")
    got, dropped = _recipe(recipe, torch.device("cpu"), _model(), own_optimizer=True)
    assert (got.optimizer_impl, got.master_weights, got.optimizer_state) == ("fused", False,
                                                                              "fp32")
    assert any("optimizer_state" in d for d in dropped)


def test_step_leaves_the_state_dict_loadable_into_the_plain_model():
    model = _model()
    step = fasttrain.Step(model, {**NO_COMPILE}, _loss, _batches(1)[0])
    step(_batches(1)[0])
    plain = _model(seed=3)
    plain.load_state_dict(copy.deepcopy(model.state_dict()))
    x = _batches(1)[0][0]
    torch.testing.assert_close(plain(x), model(x))


def test_step_runs_the_recipe_s_warm_up_and_cosine_and_leaves_your_optimizer_s_alone():
    """A recipe with lr_warmup and schedule=cosine: the step advances the schedule once per
    call (the rate after each call is the next step's); with your own optimizer the recipe's
    schedule is off, and the step says so."""
    batches = _batches(5)
    step = fasttrain.Step(_model(), {**NO_COMPILE, "lr": 1e-3, "schedule": "cosine",
                                     "lr_warmup": 2}, _loss, batches[0], total_steps=5)
    after = []
    for b in batches:
        step(b)
        after.append(float(step.optimizer.param_groups[0]["lr"]))
    assert after == pytest.approx([1e-3, 1e-3, 7.5e-4, 2.5e-4, 0.0])
    model = _model()
    mine = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = fasttrain.Step(model, mine, _loss, batches[0],
                          recipe=Recipe(compile="none", schedule="cosine", lr_warmup=3))
    assert "schedule and lr_warmup off" in str(kept)
    kept(batches[0])
    assert float(mine.param_groups[0]["lr"]) == pytest.approx(1e-3)
