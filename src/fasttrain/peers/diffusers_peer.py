"""Stable Diffusion v1 fine-tuning step, as in the Hugging Face text-to-image training recipe.

Frozen AutoencoderKL encoder and CLIPTextModel (cast to the mixed-precision weight dtype, as the
recipe does), DDPM noise, MSE on the UNet's noise prediction, EMA of the UNet. All modules are
built from config dicts in code (random weights, no hub downloads).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .loop import PeerSpec, package_version, require

VAE_SCALE = 0.18215  # SD v1 vae.config.scaling_factor
EMA_DECAY = 0.9999

UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8,
)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
CLIP = dict(  # CLIP ViT-L/14 text tower (openai/clip-vit-large-patch14)
    vocab_size=49408, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768,
)
SCHEDULER = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
FULL = {"unet": UNET, "vae": VAE, "clip": CLIP, "image": 512, "tokens": 77, "batch": 8}
TINY = {
    # 8 groups a GroupNorm (not SD's 32): with one channel a group a bias before the norm would
    # have no gradient at all, and comparisons of the tiny models would be of rounding noise
    "unet": dict(UNET, sample_size=16, block_out_channels=(32, 64), layers_per_block=1,
                 norm_num_groups=8,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32),
    "vae": dict(VAE, sample_size=32, block_out_channels=(32, 64), layers_per_block=1,
                norm_num_groups=8,
                down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
    "clip": dict(CLIP, vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, projection_dim=32),
    "image": 32, "tokens": 16, "batch": 2,
}


class VaeLatents(nn.Module):
    """``vae.encode(images).latent_dist.sample() * scaling_factor`` as one module, so it compiles."""

    def __init__(self, vae: nn.Module, scale: float = VAE_SCALE):
        super().__init__()
        self.vae, self.scale = vae, scale

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(images).latent_dist.sample() * self.scale


def build(workload: str, size: str, batch: int | None, device: torch.device, tiny: bool, recipe) -> PeerSpec:
    """UNet (trained, fp32 params) + frozen VAE encoder and text encoder + one random batch."""
    diffusers = require("diffusers")
    transformers = require("transformers")
    if size != "base":
        raise ValueError(f"peer sd has no size {size!r} (sizes: base = SD v1)")
    cfg = TINY if tiny else FULL
    batch = batch or cfg["batch"]
    # The recipe casts the frozen encoders to the mixed-precision dtype (weight_dtype).
    frozen_dtype = torch.bfloat16 if recipe.autocast else torch.float32
    unet = diffusers.UNet2DConditionModel(**cfg["unet"]).to(device).train()
    vae = diffusers.AutoencoderKL(**cfg["vae"]).to(device, frozen_dtype).eval().requires_grad_(False)
    text = transformers.CLIPTextModel(transformers.CLIPTextConfig(**cfg["clip"]))
    text = text.to(device, frozen_dtype).eval().requires_grad_(False)
    scheduler = diffusers.DDPMScheduler(**SCHEDULER)
    image, vocab = cfg["image"], cfg["clip"]["vocab_size"]
    images = torch.rand(batch, 3, image, image, device=device) * 2 - 1  # (B, 3, H, W) in [-1, 1]
    images = images.to(frozen_dtype)  # the recipe feeds the VAE in weight_dtype
    input_ids = torch.randint(0, vocab, (batch, cfg["tokens"]), device=device)  # (B, 77)
    steps = scheduler.config.num_train_timesteps

    def loss(mods: dict) -> torch.Tensor:
        with torch.no_grad():  # frozen encoders
            latents = mods["vae"](images)  # (B, 4, H/8, W/8)
            context = mods["text_encoder"](input_ids, return_dict=False)[0]  # (B, 77, 768)
        noise = torch.randn_like(latents)
        t = torch.randint(0, steps, (latents.shape[0],), device=latents.device).long()
        noisy = scheduler.add_noise(latents, noise, t)
        pred = mods["unet"](noisy, t, context, return_dict=False)[0]
        return F.mse_loss(pred.float(), noise.float(), reduction="mean")  # epsilon prediction

    modules = {"unet": unet, "vae": VaeLatents(vae), "text_encoder": text}
    info = {"unet": cfg["unet"], "vae": cfg["vae"], "clip_text": cfg["clip"], "scheduler": SCHEDULER,
            "image_size": image, "frozen_dtype": str(frozen_dtype).removeprefix("torch."),
            "ema": {"decay": EMA_DECAY, "of": "unet"},
            "unet_params": sum(p.numel() for p in unet.parameters()),
            "diffusers": package_version("diffusers"), "transformers": package_version("transformers")}
    return PeerSpec(
        public="diffusers:UNet2DConditionModel(SD-v1)+transformers:CLIPTextModel+AutoencoderKL"
        + ("(tiny)" if tiny else ""),
        trainable=unet, modules=modules, loss=loss, batch=batch, units=batch, unit="img/s",
        info=info, ema_decay=EMA_DECAY,
    )
