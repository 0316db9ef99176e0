"""Stable Diffusion v1 training step (the shapes of diffusers' ``train_text_to_image.py``).

One step: the frozen VAE encoder turns the image into latents (4 × image/8 × image/8, sampled
from the posterior, × 0.18215), the frozen CLIP text encoder embeds the caption, DDPM noise is
added at a random timestep (scaled-linear betas 0.00085 → 0.012 over 1000 steps) and the UNet
predicts that noise; the loss is the per-image mean squared error, summed over the batch.

All randomness of the step — the noise, the timestep, the posterior sample and the synthetic
caption — is drawn by the dataset from its (seed, epoch, index) generator, so every recipe
sees identical batches and nothing random runs on the device. Only the UNet trains.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .base import Workload, repeated_blocks
from .data import ImageFiles, write_synthetic_images
from ..measure.files import cache_root
from .sd_encoders import CLIPTextEncoder, TextConfig, VAEConfig, VAEEncoder
from .sd_unet import UNet, UNetConfig


@dataclass(frozen=True)
class SDConfig:
    image: int = 512
    unet: UNetConfig = field(default_factory=UNetConfig)
    text: TextConfig = field(default_factory=TextConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    train_steps: int = 1000  # DDPM timesteps
    beta_start: float = 0.00085
    beta_end: float = 0.012

    @property
    def latent(self) -> int:
        """Side of the latent image (64 at 512 px)."""
        return self.image // self.vae.factor


_TINY = SDConfig(
    image=32,  # latents 4×4
    unet=UNetConfig(channels=(32, 64), cross_attn=(True, False), heads=2, context=32),
    text=TextConfig(vocab=1000, dim=32, layers=2, heads=2, mlp=128),
    vae=VAEConfig(channels=(32, 32, 32, 32), layers=1))

CONFIGS = {
    "tiny": _TINY,
    "base": SDConfig(),
    "large": SDConfig(),  # there is no larger SD v1: the same shapes as base
}


def ddpm_alphas_cumprod(cfg: SDConfig, device=None) -> torch.Tensor:
    """ᾱ_t of diffusers' DDPMScheduler with ``beta_schedule='scaled_linear'`` (float32)."""
    betas = torch.linspace(cfg.beta_start ** 0.5, cfg.beta_end ** 0.5, cfg.train_steps,
                           dtype=torch.float32, device=device) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


class DDPMSchedule(nn.Module):
    """The forward-diffusion schedule as a float32 buffer ``alphas_cumprod``.

    In diffusers the scheduler lives outside the model and stays float32; here it is a buffer,
    so it is recomputed in float32 after every ``.to()``/``.half()`` (a bf16 ᾱ would round
    1 − ᾱ_t to 0 for small t) and after ``to_empty``.
    """

    def __init__(self, cfg: SDConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("alphas_cumprod", ddpm_alphas_cumprod(cfg), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.alphas_cumprod = ddpm_alphas_cumprod(self.cfg, self.alphas_cumprod.device)
        return self

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor,
                  timesteps: torch.Tensor) -> torch.Tensor:
        """√ᾱ_t · latents + √(1 − ᾱ_t) · noise (DDPMScheduler.add_noise)."""
        acp = self.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        return acp.sqrt().to(latents.dtype) * latents + (1 - acp).sqrt().to(latents.dtype) * noise


def normalize_sd_images(images: torch.Tensor, dtype: torch.dtype,
                        channels_last: bool = False) -> torch.Tensor:
    """uint8 (B, H, W, 3) → float (B, 3, H, W) in [-1, 1] (SD's Normalize([0.5], [0.5]))."""
    x = images.permute(0, 3, 1, 2).to(dtype).div_(127.5).sub_(1.0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return x.contiguous(memory_format=fmt)


class SDTrainStep(nn.Module):
    """The whole training step as one module: ``forward`` returns the summed loss."""

    def __init__(self, cfg: SDConfig,
                 modules: tuple[nn.Module, nn.Module, nn.Module] | None = None):
        """``modules``: (VAE encoder, text encoder, UNet) taking fasttrain's calls (below); by
        default fasttrain's own, built from ``cfg``."""
        super().__init__()
        self.cfg = cfg
        self.channels_last = False  # set by the channels_last technique
        vae, text, unet = modules or (VAEEncoder(cfg.vae), CLIPTextEncoder(cfg.text),
                                      UNet(cfg.unet))
        self.vae_encoder = vae.requires_grad_(False)  # (images, posterior noise) → latents
        self.text_encoder = text.requires_grad_(False)  # input ids → (B, tokens, width)
        self.unet = unet  # (noisy latents, timesteps, text) → predicted noise
        self.schedule = DDPMSchedule(cfg)

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, noise: torch.Tensor,
                timesteps: torch.Tensor,
                posterior_noise: torch.Tensor | None = None) -> torch.Tensor:
        latents, context = self.encode(images, input_ids, posterior_noise)
        return self.denoise(latents, context, noise, timesteps)

    def _format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    @torch.no_grad()
    def encode(self, images: torch.Tensor, input_ids: torch.Tensor,
               posterior_noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen half: (latents, caption embedding)."""
        x = normalize_sd_images(images, self.vae_encoder.conv_in.weight.dtype, self.channels_last)
        latents = self.vae_encoder(x, posterior_noise).contiguous(memory_format=self._format())
        return latents, self.text_encoder(input_ids)

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor,
                context: torch.Tensor) -> torch.Tensor:
        """The UNet's noise prediction (B, 4, h, w)."""
        return self.unet(noisy, timesteps, context)

    def denoise(self, latents: torch.Tensor, context: torch.Tensor, noise: torch.Tensor,
                timesteps: torch.Tensor) -> torch.Tensor:
        """The trained half: the UNet's noise prediction and the loss summed over the batch."""
        noise = noise.to(latents.dtype)
        noisy = self.schedule.add_noise(latents, noise, timesteps)
        pred = self.predict(noisy.contiguous(memory_format=self._format()), timesteps, context)
        per_image = F.mse_loss(pred.float(), noise.float(), reduction="none").mean(dim=(1, 2, 3))
        return per_image.sum()


def load_captions(folder: Path, files: list[Path], text: TextConfig) -> list[list[int]] | None:
    """Token ids per file from ``folder/captions.json`` ({file name: [ids]}), or None."""
    path = Path(folder) / "captions.json"
    if not path.exists():
        return None
    table = json.loads(path.read_text())
    captions = []
    for f in files:
        key = f.relative_to(folder).as_posix()
        ids = table.get(key, table.get(f.name))
        if ids is None:
            raise ValueError(f"{path} has no caption for {key}")
        if any(not 0 <= int(i) < text.vocab for i in ids):
            raise ValueError(f"{path}: caption of {key} has token ids outside [0, {text.vocab})")
        captions.append([int(i) for i in ids])
    return captions


def pad_caption(ids: list[int], text: TextConfig) -> torch.Tensor:
    """Truncate to 77 (ending in EOS, like the tokenizer) and pad with EOS (SD v1's pad token)."""
    if len(ids) > text.positions:
        ids = ids[:text.positions - 1] + [text.eos]
    return torch.tensor(ids + [text.eos] * (text.positions - len(ids)), dtype=torch.long)


class SDExtras:
    """The per-item randomness of the step, drawn from the item's generator (ImageFiles.extra)."""

    def __init__(self, cfg: SDConfig, captions: list[list[int]] | None):
        self.cfg, self.captions = cfg, captions

    def __call__(self, index: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        cfg, text = self.cfg, self.cfg.text
        shape = (cfg.vae.latent, cfg.latent, cfg.latent)
        item = {
            "noise": torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)),
            "timesteps": torch.tensor(int(rng.integers(0, cfg.train_steps)), dtype=torch.long),
            "posterior_noise": torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)),
        }
        if self.captions is not None:
            ids = self.captions[index]
        else:  # a random caption of 4..31 words: BOS, ids below BOS, EOS
            words = rng.integers(0, text.bos, size=int(rng.integers(4, 32))).tolist()
            ids = [text.bos] + words + [text.eos]
        item["input_ids"] = pad_caption(ids, text)
        return item


class SDImages(ImageFiles):
    """ImageFiles without labels, with input_ids, noise, timesteps and posterior_noise."""

    def __init__(self, folder: Path, cfg: SDConfig, seed: int = 0):
        super().__init__(folder, cfg.image, seed=seed)
        self.extra = SDExtras(cfg, load_captions(folder, self.files, cfg.text))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(index)
        del item["labels"]
        return item


class SDWorkload(Workload):
    name, unit, conv, has_ema = "sd", "img", True, True
    # Whole-pipeline compile takes minutes (the peer: 276 s); per-block compile takes far less.
    compile_scope = "regional"
    reference_lr = 1e-5  # the Hugging Face text-to-image recipe's constant rate
    prefers_channels_last = True  # a convolution UNet and VAE: the ladder tries NHWC

    def __init__(self, size: str, seed: int, data: str | None):
        self.size, self.seed, self.data_dir = size, seed, data
        self.cfg = CONFIGS[size]
        self.default_batch = {"tiny": 2, "base": 8, "large": 8}[size]

    def build_model(self) -> nn.Module:
        return SDTrainStep(self.cfg)

    def regional_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The frozen VAE encoder as one block, then the text encoder's layers and the UNet's
        stages. The VAE's stages all differ, so compiling them one by one reuses nothing; one
        graph also takes in the eager convolutions around them (the input one at 512 px, whose
        bias add alone took 0.75 ms eagerly: conv-micro-sd-20261122-0150)."""
        vae = getattr(model, "vae_encoder", None)
        if vae is None:
            return repeated_blocks(model)
        inside = set(vae.modules())
        return [vae, *(b for b in repeated_blocks(model) if b not in inside)]

    def trainable(self, model: nn.Module) -> nn.Module:
        return model.unet

    def dataset(self) -> SDImages:
        folder = self.data_dir
        if folder is None:
            count = 256 if self.size == "tiny" else 1024
            folder = write_synthetic_images(
                cache_root() / f"images-{self.cfg.image}px-{count}-c1",
                count, self.cfg.image, 1, seed=1234)
        return SDImages(Path(folder), self.cfg, seed=self.seed)


def make(size: str = "tiny", seed: int = 0, data: str | None = None) -> SDWorkload:
    return SDWorkload(size, seed, data)
