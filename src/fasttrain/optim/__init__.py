"""Optimizers whose step runs on fasttrain's kernels (the one-launch AdamW)."""
