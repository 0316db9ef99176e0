"""Real files on disk, written once into a cache folder, read through torch.utils.data.

Images are JPEG files decoded with Pillow in the DataLoader workers, randomly cropped and
flipped, and handed over as uint8 HWC tensors: the copy to the device moves 4x fewer bytes than
float32 and normalisation happens on the device, inside the model (``normalize_images``).
Augmentation randomness is keyed on (seed, epoch, index), never on worker RNG state, so every
recipe sees the same batches whatever its worker count — the basis of loss parity.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..measure.files import cache_root, write_atomic, write_folder_atomic

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def write_synthetic_images(folder: Path, count: int, size: int, classes: int, seed: int) -> Path:
    """Write ``count`` deterministic JPEGs (smooth colour fields + shapes) and a labels file.

    Atomic (``measure.files.write_folder_atomic``): a complete folder or none; reused when
    present.
    """
    def fill(tmp: Path) -> None:
        from PIL import Image, ImageDraw

        rng = np.random.default_rng(seed)
        labels = rng.integers(0, classes, size=count).tolist()
        yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
        for i in range(count):
            c0, c1, c2 = rng.random((3, 3)).astype(np.float32)
            img = np.stack([c0[k] + c1[k] * xx + c2[k] * yy for k in range(3)], axis=-1)
            img = (np.clip(img / img.max(), 0, 1) * 255).astype(np.uint8)
            pil = Image.fromarray(img)
            draw = ImageDraw.Draw(pil)
            for _ in range(3):
                x0, y0 = rng.integers(0, size, 2)
                w, h = rng.integers(size // 8, size // 2, 2)
                draw.ellipse([int(x0), int(y0), int(x0 + w), int(y0 + h)],
                             fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
            pil.save(tmp / f"{i:06d}.jpg", quality=90)
        (tmp / "labels.json").write_text(json.dumps(labels))

    return write_folder_atomic(folder, fill)


def write_pattern_images(folder: Path, count: int, size: int, classes: int, seed: int,
                         noise: float = 0.35) -> Path:
    """Write ``count`` labelled JPEGs that a model can learn, and can get wrong: class ``c`` is a
    grating at orientation ``c·180°/classes`` (±a third of the step between classes) at a random
    frequency, phase and pair of colours, under Gaussian noise of ``noise`` × full scale and a
    random occluding disc. For measuring what quantization costs a trained model (random labels
    would hide it). Flat layout with ``labels.json``; atomic; reused when present."""
    def fill(tmp: Path) -> None:
        from PIL import Image

        rng = np.random.default_rng(seed)
        labels = rng.integers(0, classes, size=count)
        yy, xx = (np.mgrid[0:size, 0:size].astype(np.float32) / size) - 0.5
        step = np.pi / classes
        for i, c in enumerate(labels):
            theta = c * step + rng.uniform(-step / 3, step / 3)
            freq, phase = rng.uniform(3, 9), rng.uniform(0, 2 * np.pi)
            wave = 0.5 + 0.5 * np.sin(2 * np.pi * freq * (xx * np.cos(theta) + yy * np.sin(theta))
                                      + phase)
            fg, bg = rng.random(3), rng.random(3)
            img = wave[..., None] * fg + (1 - wave[..., None]) * bg
            cx, cy, r = *rng.uniform(-0.5, 0.5, 2), rng.uniform(0.05, 0.25)
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.random(3)
            img = img + rng.normal(0, noise, img.shape)
            Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).save(
                tmp / f"{i:06d}.jpg", quality=90)
        (tmp / "labels.json").write_text(json.dumps(labels.tolist()))

    return write_folder_atomic(folder, fill)


def list_images(folder: Path) -> tuple[list[Path], list[int]]:
    """JPEG/PNG files of ``folder`` (sorted) and their labels (``labels.json`` or subfolders)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"image folder {folder} is a file: give the folder of your images")
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist: check the data path")
    exts = {".jpg", ".jpeg", ".png"}
    labels_file = folder / "labels.json"
    if labels_file.exists():
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in exts)
        labels = json.loads(labels_file.read_text())[: len(files)]
        return files, labels
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())  # ImageFolder layout
    files, labels = [], []
    for ci, cname in enumerate(classes):
        for p in sorted((folder / cname).iterdir()):
            if p.suffix.lower() in exts:
                files.append(p)
                labels.append(ci)
    if not files:  # a flat folder without labels: images only (SD), label 0
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in exts)
        labels = [0] * len(files)
    if not files:
        raise FileNotFoundError(f"no images in {folder}: give a folder of .jpg/.png files "
                                "(flat, or one subfolder per class)")
    return files, labels


class ImageFiles(Dataset):
    """JPEG decode (Pillow) + random-resized-ish crop + flip → uint8 (H, W, 3), label."""

    def __init__(self, folder: Path, crop: int, seed: int = 0, extra=None):
        self.files, self.labels = list_images(folder)
        self.crop, self.seed, self.epoch = crop, seed, 0
        self.extra = extra  # optional callable(index, rng) -> dict of more tensors

    def __len__(self) -> int:
        return len(self.files)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, self.epoch, index))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from PIL import Image

        rng = self.rng(index)
        with Image.open(self.files[index]) as im:
            im.draft("RGB", (self.crop, self.crop))  # JPEG DCT-domain downscale when larger
            im = im.convert("RGB")
            w, h = im.size
            if min(w, h) < self.crop:
                s = self.crop / min(w, h)
                im = im.resize((max(self.crop, round(w * s)), max(self.crop, round(h * s))))
                w, h = im.size
            x, y = int(rng.integers(0, w - self.crop + 1)), int(rng.integers(0, h - self.crop + 1))
            arr = np.array(im.crop((x, y, x + self.crop, y + self.crop)))
        if rng.random() < 0.5:
            arr = arr[:, ::-1]
        item = {"images": torch.from_numpy(np.ascontiguousarray(arr)),
                "labels": torch.tensor(self.labels[index], dtype=torch.long)}
        if self.extra is not None:
            item.update(self.extra(index, rng))
        return item


def classification_images(folder: str | Path | None, image: int, classes: int, tiny: bool,
                          seed: int) -> ImageFiles:
    """The user's image folder, or synthetic JPEGs written once (stored at 8/7 of the crop: 256 px
    for 224 px crops, so random crops have room)."""
    if folder is None:
        stored = image * 8 // 7
        count = 256 if tiny else 2048
        folder = write_synthetic_images(cache_root() / f"images-{stored}px-{count}-c{classes}",
                                        count, stored, classes, seed=1234)
    return ImageFiles(Path(folder), image, seed=seed)


def normalize_images(images: torch.Tensor, dtype: torch.dtype,
                     channels_last: bool = False) -> torch.Tensor:
    """uint8 (B, H, W, 3) → normalised float (B, 3, H, W) on the images' device.

    Per-channel scale and shift are Python scalars, not tensors made from host data: a tensor
    built from a list is a host-to-device copy, which a CUDA graph capture forbids."""
    x = images.permute(0, 3, 1, 2).to(dtype)
    x = torch.stack([x[:, c] * (1.0 / (255.0 * s)) - m / s
                     for c, (m, s) in enumerate(zip(IMAGENET_MEAN, IMAGENET_STD))], dim=1)
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def write_token_file(path: Path, count: int, vocab: int, seed: int) -> Path:
    """A flat uint32 token memmap with a learnable structure (a noisy order-1 chain)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    step = rng.integers(1, vocab, size=count, dtype=np.int64)
    noise = rng.random(count) < 0.3
    toks = np.empty(count, dtype=np.int64)
    toks[0] = 0
    jumps = np.where(noise, step, 1)
    toks = np.cumsum(jumps) % vocab
    return write_atomic(path, toks.astype(np.uint32).tofile)


class TokenWindows(Dataset):
    """Fixed-length windows of a token memmap: input ids and next-token labels."""

    def __init__(self, path: Path, seq_len: int, seed: int = 0, dtype=np.uint32):
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.seq_len, self.seed = seq_len, seed
        self.n = (len(self.tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"token file {path} is shorter than one window of {seq_len + 1}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        chunk = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


def pad_collate(items: list[dict[str, torch.Tensor]], fields: dict[str, int],
                multiple: int = 0, max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Stack items whose ``fields`` (1-D, last dim the sequence) vary in length: pad on the right
    with each field's pad value to the longest item, rounded up to a multiple of ``multiple``
    but never past ``max_len`` (the model's longest sequence)."""
    item = max(int(it[k].shape[-1]) for it in items for k in fields)
    longest = -(-item // multiple) * multiple if multiple > 1 else item
    if max_len is not None:
        longest = max(min(longest, max_len), item)
    out = {}
    for key in items[0]:
        if key in fields:
            out[key] = torch.stack([torch.nn.functional.pad(it[key], (0, longest - it[key].shape[-1]),
                                                            value=fields[key]) for it in items])
        else:
            out[key] = torch.stack([it[key] for it in items])
    return out


class VariableWindows(Dataset):
    """Windows of another token data set cut to a length drawn per index (deterministic from the
    seed): documents of varying length, as in real pre-training or fine-tuning data."""

    def __init__(self, base: TokenWindows, min_len: int, seed: int = 0):
        self.base, self.seed = base, seed
        self.min_len = max(1, min(min_len, base.seq_len))

    def __len__(self) -> int:
        return len(self.base)

    def length(self, index: int) -> int:
        rng = np.random.default_rng((self.seed, 7, index))
        return int(rng.integers(self.min_len, self.base.seq_len + 1))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = self.length(index)
        return {k: v[:n] for k, v in self.base[index].items()}
