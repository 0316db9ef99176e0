"""DCP checkpoints in one process: resume continues the uninterrupted run exactly."""
import pytest
import torch

from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.run.checkpoint import export
from fasttrain.run.loop import train
from fasttrain.workloads import load_workload


@pytest.mark.parametrize("recipe", [Recipe(batch=8, accumulation=2),
                                    Recipe(batch=4, schedule="cosine", ema="foreach"),
                                    # a warm-up of the rate that the resume continues
                                    Recipe(batch=4, lr_warmup=4),
                                    # bf16 weights: their fp32 masters come back from the
                                    # optimizer state (the one-launch AdamW, interpreted)
                                    Recipe(batch=4, precision="bf16-mixed", ema="foreach",
                                           optimizer_impl="triton", master_weights=True),
                                    # the tied embedding in bf16 too (bf16 stream), and bf16
                                    # moments, whose rounding noise is a function of the
                                    # element and the step: the resume draws the same noise
                                    Recipe(batch=4, precision="bf16-mixed", stream_dtype="bf16",
                                           optimizer_impl="triton", master_weights=True,
                                           optimizer_state="bf16"),
                                    # the shadow optimizer: its fp32 copies and their AdamW
                                    # state, saved by the weights' names
                                    Recipe(batch=4, offload="optimizer"),
                                    Recipe(batch=4, precision="bf16-true", master_weights=True)])
def test_resume_continues_the_straight_run(tmp_path, recipe):
    wl = load_workload("llama", "tiny")
    straight = train(wl, recipe, steps=6, warmup=0).losses
    first = train(wl, recipe, steps=3, warmup=0, save_to=str(tmp_path / "c")).losses
    second = train(wl, recipe, steps=3, warmup=0, resume_from=str(tmp_path / "c")).losses
    if recipe.schedule == "cosine":  # the horizon is each run's length: the learning rates
        # differ from step 2 on; resume restores the schedule and the EMA and runs on
        assert first[0] == straight[0] and len(second) == 3
        assert all(torch.isfinite(torch.tensor(second)))
        return
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight),
                               rtol=1e-6, atol=0)


def test_resume_refuses_a_different_batch_and_unsupported_recipes(tmp_path):
    wl = load_workload("vit", "tiny")
    train(wl, Recipe(batch=8), steps=1, warmup=0, save_to=str(tmp_path / "c"))
    with pytest.raises(FasttrainError, match="batch=8"):
        train(wl, Recipe(batch=4), steps=1, warmup=0, resume_from=str(tmp_path / "c"))
    train(wl, Recipe(batch=8, offload="optimizer"), steps=1, warmup=0,
          save_to=str(tmp_path / "d"))
    with pytest.raises(FasttrainError, match="optimizer state is an offloaded or master-weight"):
        train(wl, Recipe(batch=8), steps=1, warmup=0, resume_from=str(tmp_path / "d"))
    with pytest.raises(FasttrainError, match="no fasttrain checkpoint"):
        train(wl, Recipe(), steps=1, warmup=0, resume_from=str(tmp_path / "missing"))


def test_export_writes_one_consolidated_file(tmp_path):
    wl = load_workload("vit", "tiny")
    train(wl, Recipe(), steps=1, warmup=0, save_to=str(tmp_path / "c"))
    full = torch.load(export(tmp_path / "c", tmp_path / "m.pt"), weights_only=False)
    assert full["model"]["head.weight"].shape == (10, 64) and "optim" in full
    # bf16 weights with fp32 masters: the checkpoint's model weights are the fp32 masters
    masters = Recipe(precision="bf16-mixed", optimizer_impl="triton", master_weights=True)
    train(wl, masters, steps=1, warmup=0, save_to=str(tmp_path / "d"))
    full = torch.load(export(tmp_path / "d", tmp_path / "n.pt"), weights_only=False)
    head = full["model"]["head.weight"]
    assert head.dtype == torch.float32 and not torch.equal(head, head.bfloat16().float())
    with pytest.raises(FasttrainError, match="master_weights=True, this run master_weights=False"):
        train(wl, masters.replace(master_weights=False), steps=1, warmup=0,
              resume_from=str(tmp_path / "d"))


def _cli_losses(capsys, *argv) -> list[float]:
    import json

    from fasttrain.cli import main

    assert main(["train", "llama", "--device", "cpu", "--warmup", "0", "--json", *argv]) == 0
    out, err = capsys.readouterr()
    return json.loads(out)["losses"], err


def test_resume_auto_starts_then_continues_the_newest_save(tmp_path, capsys):
    """A job script that always says --resume auto: the first start has nothing to continue,
    a restart continues the newest save, and the two runs make the straight run's losses."""
    common = ["--out", str(tmp_path / "o"), "--set", "batch=4"]
    straight, _ = _cli_losses(capsys, "--steps", "6", *common)
    ckpt = ["--save", str(tmp_path / "c"), "--resume", "auto", *common]
    first, said = _cli_losses(capsys, "--steps", "3", *ckpt)
    assert f"resume: no complete save in {tmp_path / 'c'} yet: starting from step 0" in said
    second, said = _cli_losses(capsys, "--steps", "3", *ckpt)
    assert f"resume: continuing {tmp_path / 'c' / 'step-000003'}" in said
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight),
                               rtol=1e-6, atol=0)


def test_resume_auto_passes_over_a_first_save_that_was_cut_off(tmp_path, capsys):
    (tmp_path / "c" / ".step-000003.tmp").mkdir(parents=True)  # killed inside its first save
    _, said = _cli_losses(capsys, "--steps", "1", "--save", str(tmp_path / "c"), "--resume",
                          "auto", "--out", str(tmp_path / "o"))
    assert "starting from step 0" in said


def test_resume_takes_this_run_s_rate_into_the_device_rate(tmp_path):
    """The one-launch AdamW keeps its rate on the device, and its checkpoint stores it as a
    number: loading never writes the saved rate into the live tensor, so a resume runs at this
    run's rate."""
    import torch.distributed.checkpoint as dcp

    wl = load_workload("llama", "tiny")
    base = Recipe(batch=4, optimizer_impl="triton", lr=1e-3)
    train(wl, base, steps=2, warmup=0, save_to=str(tmp_path / "c"))
    meta = dcp.FileSystemReader(str(tmp_path / "c" / "step-000002")).read_metadata()
    assert type(meta.state_dict_metadata["optim.param_groups.0.lr"]).__name__ == \
        "BytesStorageMetadata"  # a number, not a tensor
    again = train(wl, base.replace(lr=2e-3), steps=2, warmup=0, resume_from=str(tmp_path / "c"))
    assert again.lrs == pytest.approx([2e-3, 2e-3])


def test_resume_starts_a_warm_up_after_a_constant_rate_and_keeps_a_saved_one(tmp_path):
    """From a checkpoint saved at a constant rate, the resumed run's warm-up starts where it
    resumes (fine-tuning); a checkpoint saved with a warm-up continues it as saved, and a
    different lr_warmup asked of the resumed run is warned about and not used."""
    wl = load_workload("llama", "tiny")
    base = Recipe(batch=4, lr=1e-3)
    train(wl, base, steps=2, warmup=0, save_to=str(tmp_path / "c"))
    tuned = train(wl, base.replace(lr_warmup=2), steps=3, warmup=0,
                  resume_from=str(tmp_path / "c"))
    assert tuned.lrs == pytest.approx([5e-4, 1e-3, 1e-3])
    train(wl, base.replace(lr_warmup=4), steps=2, warmup=0, save_to=str(tmp_path / "d"))
    other = train(wl, base.replace(lr_warmup=1), steps=2, warmup=0,
                  resume_from=str(tmp_path / "d"))
    assert other.lrs == pytest.approx([7.5e-4, 1e-3])  # steps 2 and 3 of the saved warm-up
    assert any("lr_warmup=4" in w and "continues as saved" in w for w in other.warnings)


def test_resume_under_another_adamw_implementation_continues_the_run(tmp_path):
    """A checkpoint of the one-launch AdamW resumes under PyTorch's (and back): the settings
    the saved optimizer's groups lack keep this run's values, and the losses continue the
    straight run's (the same AdamW arithmetic)."""
    wl = load_workload("llama", "tiny")
    flat = Recipe(batch=4, optimizer_impl="triton")
    straight = train(wl, flat, steps=4, warmup=0).losses
    first = train(wl, flat, steps=2, warmup=0, save_to=str(tmp_path / "c")).losses
    second = train(wl, flat.replace(optimizer_impl="foreach"), steps=2, warmup=0,
                   resume_from=str(tmp_path / "c")).losses
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight),
                               rtol=1e-5, atol=0)
    train(wl, flat.replace(optimizer_impl="foreach"), steps=2, warmup=0,
          save_to=str(tmp_path / "d"))
    back = train(wl, flat, steps=1, warmup=0, resume_from=str(tmp_path / "d"))
    assert all(torch.isfinite(torch.tensor(back.losses))) and not back.warnings


def test_a_constant_rate_resume_of_a_scheduled_checkpoint_says_it_does_not_continue_it(tmp_path):
    wl = load_workload("vit", "tiny")
    train(wl, Recipe(batch=8, schedule="cosine"), steps=2, warmup=0, save_to=str(tmp_path / "c"))
    run = train(wl, Recipe(batch=8), steps=1, warmup=0, resume_from=str(tmp_path / "c"))
    assert any("schedule is not continued" in w for w in run.warnings), run.warnings


@pytest.mark.parametrize("saved_stream, resumed_stream", [("auto", "bf16"), ("bf16", "auto")])
def test_resume_across_the_embedding_s_storage_keeps_its_fp32_weights(tmp_path, saved_stream,
                                                                      resumed_stream):
    """master_weights stores Llama's tied embedding in bf16 (with an fp32 master) only with the
    bf16 stream. Saved one way and resumed the other, the embedding's fp32 weights come back
    exactly: as the master the checkpoint lacks (taken from its model entry, not from the
    rounded weight), or as the fp32 weight itself."""
    from fasttrain.run import checkpoint
    from fasttrain.run.loop import prepare

    wl = load_workload("llama", "tiny")
    base = Recipe(batch=4, precision="bf16-mixed", optimizer_impl="triton", master_weights=True)
    train(wl, base.replace(stream_dtype=saved_stream), steps=2, warmup=0,
          save_to=str(tmp_path / "c"))
    saved = checkpoint.model_weights(tmp_path / "c")["embed_tokens.weight"]
    assert saved.dtype == torch.float32 and not torch.equal(saved, saved.bfloat16().float())
    state, _, _ = prepare(wl, base.replace(stream_dtype=resumed_stream), torch.device("cpu"))
    assert checkpoint.load(state, tmp_path / "c") == 2
    emb = state.model.embed_tokens.weight
    now = dict(zip(map(id, state.optimizer.params), state.optimizer.masters))[id(emb)]
    assert torch.equal(now if now is not None else emb.detach(), saved)
    second = train(wl, base.replace(stream_dtype=resumed_stream), steps=1, warmup=0,
                   resume_from=str(tmp_path / "c")).losses
    assert all(torch.isfinite(torch.tensor(second)))
