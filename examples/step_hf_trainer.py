"""Hugging Face ``Trainer`` with ``fasttrain.Step``: the Trainer keeps its loop (data, logging,
saving, the learning-rate schedule) and the Step does the training step (a tiny Llama).

    python -m examples.step_hf_trainer

The Trainer normally runs backward, clipping and the optimizer step itself. Here its
``training_step`` calls the Step, which does all three on the Trainer's own optimizer and
scheduler (the Step makes the optimizer capturable; the scheduler updates its learning rate in
place). So that nothing runs twice, the Trainer's own clipping is off (``max_grad_norm=0``: the
Step clips at 1.0) and the Trainer's call of its optimizer wrapper's step does nothing.
"""
from __future__ import annotations

import tempfile

import torch

from examples.convert_hf_trainer import TokenWindows


def loss_fn(model, batch):
    return model(**batch).loss


def main(steps: int = 3, use_step: bool = True, lr: float = 1e-3) -> tuple[list[float], str]:
    """Train ``steps`` steps of a tiny Llama with the Trainer; returns the losses and the step's
    report."""
    import transformers

    import fasttrain
    from fasttrain.peers.hf_llama_peer import TINY, llama_config

    class StepTrainer(transformers.Trainer):
        fstep = None

        def training_step(self, model, inputs, num_items_in_batch=None):
            if not use_step:
                return super().training_step(model, inputs, num_items_in_batch)
            inputs = self._prepare_inputs(inputs)
            if self.fstep is None:
                # the Trainer's optimizer is accelerate's wrapper around the real one: the Step
                # steps the real one, and the wrapper's own step (the Trainer's) does nothing
                inner = self.optimizer.optimizer
                self.optimizer.step = lambda *a, **k: None
                self.fstep = fasttrain.Step(model, inner, loss_fn, inputs,
                                            recipe={"compile": "none"})
            return self.fstep(inputs)

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    config = llama_config(transformers, TINY)
    model = transformers.LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=2, learning_rate=lr,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=not cuda,
            dataloader_num_workers=0, seed=0, disable_tqdm=True,
            max_grad_norm=0.0 if use_step else 1.0, dataloader_drop_last=True)
        trainer = StepTrainer(model=model, args=args,
                              train_dataset=TokenWindows(config.vocab_size, 64))
        trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, repr(trainer.fstep) if use_step else "plain"


if __name__ == "__main__":
    losses, report = main()
    print(report)
    print("losses:", losses)
