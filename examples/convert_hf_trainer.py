"""Hugging Face ``Trainer`` with fasttrain's fused kernels: a transformers Llama converted in
place before the Trainer sees it.

    python -m examples.convert_hf_trainer

The converted model keeps its class's methods (``save_pretrained``, ``generate``) and its state
dict. Batches without an ``attention_mask`` (packed or equal-length sequences) take the fused
path; a padding mask hands the call back to the library's own forward.
"""
from __future__ import annotations

import tempfile

import torch


class TokenWindows(torch.utils.data.Dataset):
    """Random token windows; labels = input ids (the model shifts them)."""

    def __init__(self, vocab: int, seq: int, count: int = 64):
        self.ids = torch.randint(0, vocab, (count, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(steps: int = 3, convert: bool = True, tiny: bool = True) -> tuple[list[float], str]:
    """Train ``steps`` steps of a (tiny) Llama with the Trainer; returns the losses and what
    convert did."""
    import transformers

    import fasttrain
    from fasttrain.peers.hf_llama_peer import LLAMA_1B, TINY, llama_config

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    config = llama_config(transformers, TINY if tiny else LLAMA_1B)
    model = transformers.LlamaForCausalLM(config)
    report = fasttrain.convert(model, kernels="fused" if cuda else "none").summary() \
        if convert else "not converted"
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-4,
            logging_steps=1, report_to=[], save_strategy="no", bf16=cuda, use_cpu=not cuda,
            dataloader_num_workers=0, seed=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args,
                                       train_dataset=TokenWindows(config.vocab_size, 64))
        trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, report


if __name__ == "__main__":
    losses, report = main()
    print(report)
    print("losses:", losses)
