"""diffusers' Stable Diffusion v1 as a workload: ``diffusers:sd-v1``.

The public classes a user trains: ``diffusers.UNet2DConditionModel`` at SD v1's config (trained),
``diffusers.AutoencoderKL`` and ``transformers.CLIPTextModel`` (frozen), built from config dicts
(random weights, or ``weights=FILE``: a ``.safetensors`` state dict of the UNet, every key
checked; no download, ever). The step is fasttrain's SD step (``workloads/sd.py``): the same
data pipeline, the dataset's noise, timesteps and posterior sample, the DDPM schedule and the
per-image MSE. Only the callables differ, each the library's own: ``vae.encoder`` and
``quant_conv`` then the posterior sample, the text model's last hidden state, and the UNet's
``forward``. The ``convert`` switch turns the diffusers classes into fasttrain's layers
(``converters/diffusers_sd.py``); the ladder's peer is the same three models under PyTorch best
practice (``peers/diffusers_peer.py``). Sizes: ``base`` is SD v1; ``tiny`` a miniature of the
same classes, for tests.
"""
from __future__ import annotations

import torch
from torch import nn

from ..peers.diffusers_peer import FULL, TINY
from .sd import SDConfig, SDTrainStep, SDWorkload
from .sd_encoders import TextConfig, VAEConfig
from .weights import check_weights, load_weights

MODELS = ("sd-v1",)


def import_diffusers():
    try:
        import diffusers
        import transformers
    except ImportError as err:
        raise ValueError(f"diffusers workloads need diffusers and transformers "
                         f"(pip install diffusers transformers): {err}") from None
    return diffusers, transformers


class VAELatents(nn.Module):
    """An ``AutoencoderKL``'s encoding half as the step calls it: ``(images, posterior noise)``
    → ``(mean + std · noise) × scaling_factor`` of its diagonal Gaussian (the library's
    ``encode(images).latent_dist.sample()``, with the noise drawn by the dataset). It keeps the
    library's ``encoder`` and ``quant_conv`` modules (state dict keys ``encoder.…`` and
    ``quant_conv.…`` as in the VAE's); the decoder, which training never runs, is not kept."""

    def __init__(self, vae: nn.Module, scale: float):
        super().__init__()
        self.encoder, self.quant_conv, self.scale = vae.encoder, vae.quant_conv, scale

    @property
    def conv_in(self) -> nn.Conv2d:
        return self.encoder.conv_in

    def forward(self, images: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        h = self.encoder(images)
        if self.quant_conv is not None:
            h = self.quant_conv(h)
        mean, logvar = h.chunk(2, dim=1)
        if noise is not None:
            std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
            mean = mean + std * noise.to(mean.dtype)
        return mean * self.scale


class TextHidden(nn.Module):
    """A ``CLIPTextModel`` as the step calls it: input ids → its last hidden state."""

    def __init__(self, text: nn.Module):
        super().__init__()
        self.text = text

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text(input_ids, return_dict=False)[0]


class DiffusersSDStep(SDTrainStep):
    """fasttrain's SD step over diffusers' UNet, VAE and transformers' CLIP text model."""

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor,
                context: torch.Tensor) -> torch.Tensor:
        return self.unet(noisy, timesteps, context, return_dict=False)[0]


def data_config(cfg: dict) -> SDConfig:
    """fasttrain's SD config of the data (image and latent sizes, the text's vocabulary and
    length) for a diffusers config dict (``peers.diffusers_peer.FULL`` or ``TINY``)."""
    clip, vae = cfg["clip"], cfg["vae"]
    text = TextConfig(vocab=clip["vocab_size"], positions=cfg["tokens"], dim=clip["hidden_size"])
    return SDConfig(image=cfg["image"], text=text,
                    vae=VAEConfig(channels=tuple(vae["block_out_channels"]),
                                  latent=vae["latent_channels"]))


class DiffusersSDWorkload(SDWorkload):
    converts = True

    def __init__(self, model: str, size: str, seed: int, data: str | None, weights: str | None):
        if model not in MODELS:
            raise ValueError(f"diffusers:{model} is not a workload: use diffusers:sd-v1")
        if size not in ("tiny", "base"):
            raise ValueError(f"diffusers:{model} has sizes tiny and base (SD v1), not {size!r}")
        self.diffusers, self.transformers = import_diffusers()
        self.name, self.size, self.seed, self.data_dir = f"diffusers:{model}", size, seed, data
        self.configs = TINY if size == "tiny" else FULL
        self.cfg = data_config(self.configs)
        self.default_batch = self.configs["batch"]
        self.weights = weights
        if weights is not None:
            with torch.device("meta"):
                check_weights(self.diffusers.UNet2DConditionModel(**self.configs["unet"]), weights)

    def build_model(self) -> nn.Module:
        unet = self.diffusers.UNet2DConditionModel(**self.configs["unet"])
        if self.weights is not None:
            load_weights(unet, self.weights)
        vae = self.diffusers.AutoencoderKL(**self.configs["vae"])
        vocab = self.configs["clip"]["vocab_size"]  # CLIP's last two ids: BOS, EOS (pads)
        clip = self.transformers.CLIPTextConfig(**self.configs["clip"], bos_token_id=vocab - 2,
                                                eos_token_id=vocab - 1)
        text = self.transformers.CLIPTextModel(clip)
        return DiffusersSDStep(self.cfg, (VAELatents(vae, self.cfg.vae.scale), TextHidden(text),
                                          unet))

    def regional_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The VAE encoder as one block, then the UNet's stages; the text encoder runs eagerly.
        transformers builds the text model's causal mask another way while a CUDA graph is being
        captured (its ``is_tracing()`` is true then), so a compiled text layer met new inputs
        inside the capture and recompiled there, which cannot be done during a capture. Its
        forward is 77 tokens a caption and runs without gradients: eager costs little."""
        text = set(model.text_encoder.modules())
        return [b for b in super().regional_blocks(model) if b not in text]

    def describe(self) -> dict:
        return {**super().describe(), "unet": self.configs["unet"], "weights": self.weights,
                "diffusers": self.diffusers.__version__,
                "transformers": self.transformers.__version__}


def make(model: str, size: str = "tiny", seed: int = 0, data: str | None = None,
         weights: str | None = None) -> DiffusersSDWorkload:
    return DiffusersSDWorkload(model, size, seed, data, weights)
