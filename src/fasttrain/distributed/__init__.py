"""torch.distributed: torchrun launch, process groups with bounded timeouts, DDP and FSDP2."""
