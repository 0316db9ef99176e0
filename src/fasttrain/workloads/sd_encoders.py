"""The frozen halves of Stable Diffusion v1 training: the text encoder and the VAE encoder.

``CLIPTextEncoder`` has the shapes of transformers' ``CLIPTextModel`` (ViT-L/14 text tower:
49408 tokens, 77 positions, 12 pre-LN layers of width 768, quick-GELU MLPs, causal attention,
final LayerNorm; 123,060,480 parameters) and returns ``last_hidden_state`` (B, 77, 768).
``VAEEncoder`` is diffusers' ``AutoencoderKL`` encoder plus ``quant_conv`` (34,163,664
parameters) and returns latents sampled from the diagonal Gaussian, scaled by 0.18215.
Both run under ``torch.no_grad`` in the training step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import attention
from ..layers.norm import GroupNorm
from ..layers.mlp import Mlp
from ..layers.unet import NORM_GROUPS, Downsample, ResnetBlock


@dataclass(frozen=True)
class TextConfig:
    vocab: int = 49408
    positions: int = 77
    dim: int = 768
    layers: int = 12
    heads: int = 12
    mlp: int = 3072
    eps: float = 1e-5

    @property
    def bos(self) -> int:  # <|startoftext|>: 49406 in the CLIP vocabulary
        return self.vocab - 2

    @property
    def eos(self) -> int:  # <|endoftext|>: 49407, also SD v1's padding token
        return self.vocab - 1


@dataclass(frozen=True)
class VAEConfig:
    channels: tuple[int, ...] = (128, 256, 512, 512)
    layers: int = 2  # ResNet blocks per down stage
    latent: int = 4
    eps: float = 1e-6
    scale: float = 0.18215  # SD v1 latent scaling factor

    @property
    def factor(self) -> int:
        """Image pixels per latent pixel along each side (8 for SD v1)."""
        return 2 ** (len(self.channels) - 1)


class QuickGELUMlp(Mlp):
    """fc1 → x·sigmoid(1.702x) → fc2 (CLIP's ``quick_gelu``); no fused path."""

    use_fused = None  # the bias + GELU kernel computes GELU, not quick-GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


class CLIPAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = attention(q, k, v, causal=True)  # (B, H, T, D)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, C))


class CLIPLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.self_attn = CLIPAttention(cfg.dim, cfg.heads)
        self.layer_norm2 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.mlp = QuickGELUMlp(cfg.dim, cfg.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPTextEncoder(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.token_embedding = nn.Embedding(cfg.vocab, cfg.dim)
        self.position_embedding = nn.Embedding(cfg.positions, cfg.dim)
        nn.init.normal_(self.token_embedding.weight, std=0.02)  # transformers' CLIP init
        nn.init.normal_(self.position_embedding.weight, std=0.01)
        self.layers = nn.ModuleList(CLIPLayer(cfg) for _ in range(cfg.layers))
        self.final_layer_norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T ≤ 77) → last hidden state (B, T, dim)."""
        x = self.token_embedding(input_ids) + self.position_embedding.weight[:input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.final_layer_norm(x)


class VAEAttention(nn.Module):
    """The VAE mid-block attention: GroupNorm, one head over all H·W positions, residual."""

    def __init__(self, ch: int, eps: float):
        super().__init__()
        self.group_norm = GroupNorm(NORM_GROUPS, ch, eps=eps)
        self.to_q = nn.Linear(ch, ch)
        self.to_k = nn.Linear(ch, ch)
        self.to_v = nn.Linear(ch, ch)
        self.to_out = nn.Sequential(nn.Linear(ch, ch))  # diffusers' to_out.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.group_norm(x).flatten(2).transpose(1, 2)  # (B, HW, C)
        q, k, v = (proj(h).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = self.to_out(attention(q, k, v).squeeze(1))  # (B, HW, C)
        return x + out.transpose(1, 2).reshape(B, C, H, W)


class VAEDownBlock(nn.Module):
    """diffusers ``DownEncoderBlock2D``: ResNets without time embedding, then downsample."""

    def __init__(self, cin: int, cout: int, cfg: VAEConfig, down: bool):
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout, None, cfg.eps)
                                     for i in range(cfg.layers))
        self.downsamplers = nn.ModuleList([Downsample(cout, asymmetric=True)]) if down else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.downsamplers is None else self.downsamplers[0](x)


class VAEMidBlock(nn.Module):
    """diffusers ``UNetMidBlock2D`` of the VAE: ResNet → attention → ResNet."""

    def __init__(self, ch: int, eps: float):
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(ch, ch, None, eps) for _ in range(2))
        self.attentions = nn.ModuleList([VAEAttention(ch, eps)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class VAEEncoder(nn.Module):
    """``AutoencoderKL.encoder`` + ``quant_conv``: image in [-1, 1] → scaled latents."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg
        ch, n = cfg.channels, len(cfg.channels)
        self.conv_in = nn.Conv2d(3, ch[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            VAEDownBlock(ch[max(i - 1, 0)], ch[i], cfg, i < n - 1) for i in range(n))
        self.mid_block = VAEMidBlock(ch[-1], cfg.eps)
        self.conv_norm_out = GroupNorm(NORM_GROUPS, ch[-1], eps=cfg.eps, silu=True)
        self.conv_out = nn.Conv2d(ch[-1], 2 * cfg.latent, 3, padding=1)  # mean, logvar
        self.quant_conv = nn.Conv2d(2 * cfg.latent, 2 * cfg.latent, 1)

    def forward(self, images: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """``mean + std·noise`` of the posterior (its mean when ``noise`` is None) × scale."""
        x = self.conv_in(images)
        for blk in self.down_blocks:
            x = blk(x)
        x = self.conv_out(self.conv_norm_out(self.mid_block(x)))
        mean, logvar = self.quant_conv(x).chunk(2, dim=1)
        if noise is not None:
            std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
            mean = mean + std * noise.to(mean.dtype)
        return mean * self.cfg.scale
