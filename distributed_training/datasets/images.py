"""A directory of images as a classification dataset: ``root/<class>/<image>``, decoded with Pillow.

    root/
      cat/0001.jpg  cat/0002.png ...
      dog/0001.jpg ...

Classes are the sub-directories' names, sorted (label 0 is the first); images are the files with an
image extension under each, at any depth, sorted. Each sample is decoded when it is read (by the
DataLoader's worker processes when ``num_workers > 0``) and transformed to a ``uint8`` tensor of
shape (3, image_size, image_size): 4x smaller than floats to pass between processes and to copy to
the GPU; the model turns it into normalised floats on its device (see `models.vision`).

* `TrainTransform`: random-resized crop (a random area of ``min_scale`` to 1 of the image, aspect
  ratio 3/4 to 4/3, resized to the output size) then a horizontal flip half of the time, the
  augmentation of Inception / ResNet training.
* `EvalTransform`: the shorter side resized to ``image_size / crop_fraction``, then the central
  ``image_size`` square (``crop_fraction`` 0.875: 256 -> 224), deterministic.

Decoding can be what bounds a job: a `DecodeMeter` shared by the dataset's copies in the worker
processes counts the images decoded and the seconds spent, and `InputWatch` compares the rate the
workers can decode at with the rate training took them at (see `InputWatch.summary`).

`write_digits_folder` writes the package's 8x8 digits, upsampled, as such a folder: a real dataset
to check a recipe's accuracy on without downloading anything.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

__all__ = ["ImageFolder", "TrainTransform", "EvalTransform", "DecodeMeter", "InputWatch", "find_images",
           "write_digits_folder", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm")


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is in the `images` extra
        raise ImportError("reading image folders needs Pillow: pip install 'distributed_training[images]'") from None
    return Image


def find_images(root: str | Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(class names sorted, [(path, label), ...] sorted by class then path) of an image folder."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {str(root)!r} does not exist or is not a directory")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {str(root)!r} has no class directories (expected root/<class>/<image>)")
    samples, empty = [], []
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        samples += [(str(p), label) for p in files]
        if not files:
            empty.append(name)
    if empty and samples:  # a class without images would still get an output of the head, silently
        raise ValueError(f"image folder {str(root)!r}: class director{'y' if len(empty) == 1 else 'ies'} "
                         f"{', '.join(repr(e) for e in empty[:5])}{' ...' if len(empty) > 5 else ''} hold(s) no images "
                         f"({', '.join(IMAGE_EXTENSIONS)}): remove or fill them (every directory is a class)")
    if not samples:
        raise ValueError(f"image folder {str(root)!r} has no images ({', '.join(IMAGE_EXTENSIONS)}) under its "
                         f"{len(classes)} class directories")
    return classes, samples


def _rgb(img):
    """`img` as 8-bit RGB. 16-bit grayscale (modes I;16*, I) is scaled to 8 bits first: Pillow's own
    conversion clips it, turning nearly every pixel white."""
    if img.mode.startswith("I;16") or img.mode == "I":
        values = np.asarray(img, dtype=np.int64)
        top = 65535 if img.mode.startswith("I;16") or values.max(initial=0) > 255 else 255
        img = _pil().fromarray(np.clip(values * 255 // top, 0, 255).astype(np.uint8), mode="L")
    return img.convert("RGB")


def _to_tensor(img) -> torch.Tensor:
    """A PIL RGB image as a (3, H, W) uint8 tensor."""
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


class EvalTransform:
    """Resize the shorter side to ``round(image_size / crop_fraction)`` (bilinear, antialiased), take the
    central ``image_size`` square."""

    def __init__(self, image_size: int, crop_fraction: float = 0.875) -> None:
        if not 0 < crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction}")
        self.image_size, self.crop_fraction = image_size, crop_fraction

    def __call__(self, img) -> torch.Tensor:
        Image = _pil()
        w, h = img.size
        short = max(self.image_size, round(self.image_size / self.crop_fraction))
        nw, nh = (short, max(short, round(h * short / w))) if w <= h else (max(short, round(w * short / h)), short)
        if (nw, nh) != (w, h):
            img = img.resize((nw, nh), Image.BILINEAR)
        left, top = (nw - self.image_size) // 2, (nh - self.image_size) // 2
        return _to_tensor(img.crop((left, top, left + self.image_size, top + self.image_size)))


class TrainTransform:
    """Random-resized crop (area ``min_scale``..1 of the image, aspect ratio 3/4..4/3), resized to
    ``image_size`` square (bilinear, antialiased), flipped left-right with probability 1/2 if ``hflip``.
    Random numbers come from torch's generator, which the DataLoader seeds per worker."""

    def __init__(self, image_size: int, min_scale: float = 0.08, hflip: bool = True) -> None:
        if not 0 < min_scale <= 1:
            raise ValueError(f"min_scale must be in (0, 1], got {min_scale}")
        self.image_size, self.min_scale, self.hflip = image_size, min_scale, hflip

    def crop_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of a random crop of a ``width`` x ``height`` image."""
        area = width * height
        log_ratio = (math.log(3 / 4), math.log(4 / 3))
        for _ in range(10):
            u = torch.rand(4).tolist()
            target = area * (self.min_scale + (1 - self.min_scale) * u[0])
            ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[1])
            w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
            if 0 < w <= width and 0 < h <= height:
                left, top = int(u[2] * (width - w + 1)), int(u[3] * (height - h + 1))
                return left, top, left + w, top + h
        # Rarely (very elongated images): the largest central crop of an allowed aspect ratio.
        ratio = min(max(width / height, 3 / 4), 4 / 3)
        w, h = (width, round(width / ratio)) if width / height < ratio else (round(height * ratio), height)
        w, h = min(w, width), min(h, height)
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def __call__(self, img) -> torch.Tensor:
        Image = _pil()
        box = self.crop_box(*img.size)
        img = img.resize((self.image_size, self.image_size), Image.BILINEAR, box=box)
        if self.hflip and torch.rand(()).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _to_tensor(img)


class DecodeMeter:
    """Images decoded and seconds spent decoding (and transforming) them, in shared memory: the
    dataset's copies in DataLoader workers each add to their own row (row 0: the training process)."""

    def __init__(self, slots: int = 256) -> None:
        self.counts = torch.zeros(slots, 2, dtype=torch.float64).share_memory_()

    def add(self, seconds: float) -> None:
        info = get_worker_info()
        row = 0 if info is None else 1 + info.id % (len(self.counts) - 1)
        self.counts[row, 0] += 1
        self.counts[row, 1] += seconds

    def totals(self) -> tuple[float, float]:
        """(images, seconds) so far, over every process."""
        images, seconds = self.counts.sum(0).tolist()
        return images, seconds


class ImageFolder(Dataset):
    """(image (3, S, S) uint8, label int) samples of an image folder (see the module's docstring).

    Args:
        root: the folder (``root/<class>/<image>``).
        transform: PIL image -> uint8 tensor (`TrainTransform`, `EvalTransform` or your own).
        samples, classes: use these [(path, label)] and class names instead of scanning `root`
            (`split` gives a folder's samples to two datasets with different transforms).
        meter: where decoding is counted (a new `DecodeMeter` by default).
    """

    def __init__(self, root: str | Path, transform: Callable, *, samples: Sequence[tuple[str, int]] | None = None,
                 classes: Sequence[str] | None = None, meter: DecodeMeter | None = None) -> None:
        if samples is None or classes is None:
            classes, samples = find_images(root)
        self.root, self.transform = str(root), transform
        self.classes, self.samples = list(classes), list(samples)
        self.meter = meter if meter is not None else DecodeMeter()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[i]
        start = time.perf_counter()
        try:
            with _pil().open(path) as img:
                image = self.transform(_rgb(img))
        except (OSError, ValueError, SyntaxError) as err:  # what Pillow raises on a file it cannot decode
            raise OSError(f"image folder {self.root!r}: cannot decode {path!r}: {type(err).__name__}: {err}") from err
        self.meter.add(time.perf_counter() - start)
        return image, label

    def split(self, val_fraction: float, seed: int, val_transform: Callable) -> tuple["ImageFolder", "ImageFolder"]:
        """(train, validation): a seeded random `val_fraction` of the samples held out, read with
        `val_transform`; the same split on every rank for the same seed."""
        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(seed)).tolist()
        n_val = int(len(order) * val_fraction)
        pick = lambda idx: [self.samples[k] for k in sorted(idx)]  # noqa: E731
        train = ImageFolder(self.root, self.transform, samples=pick(order[n_val:]), classes=self.classes,
                            meter=self.meter)
        val = ImageFolder(self.root, val_transform, samples=pick(order[:n_val]), classes=self.classes)
        return train, val


class InputWatch:
    """Whether decoding or training bounds a run: started before `fit`, read after.

    Over the watched interval it takes the images the dataset decoded (this rank's, every worker
    together; a few prefetched batches more than were trained) and the seconds spent decoding them,
    and gives: the rate training consumed images at (images / wall seconds), the rate one process
    decodes at (images / decoding seconds), and what the input pipeline could deliver (that times the
    workers). With workers, training that consumes near that capacity (above 80% of it) waited on the
    input; with ``num_workers=0`` the decoding is part of every step, and its share of the wall time is
    what workers would take off. Given the seconds the training loop waited for its batches (`summary`'s
    `waited_s`: `fit` counts them), a wait of more than 20% of the wall time is input-bound too: the
    workers started again each epoch, or too few of them, whatever their decode rate."""

    def __init__(self, meter: DecodeMeter, num_workers: int) -> None:
        self.meter, self.num_workers = meter, num_workers
        self.start_images, self.start_seconds = meter.totals()
        self.start = time.perf_counter()

    def summary(self, waited_s: float | None = None) -> dict[str, float | str]:
        images, seconds = self.meter.totals()
        images, seconds = images - self.start_images, seconds - self.start_seconds
        wall = time.perf_counter() - self.start
        if images == 0 or wall <= 0:
            return {}
        per_process = images / seconds if seconds > 0 else math.inf
        workers = max(1, self.num_workers)
        out: dict[str, float | str] = {"images": images, "trained_images_per_s": images / wall,
                                       "decoded_images_per_s_per_process": per_process,
                                       "decode_capacity_images_per_s": per_process * workers,
                                       "decode_share_of_wall": seconds / wall / workers}
        waited = None if waited_s is None else waited_s / wall
        if waited is not None:
            out["waited_share_of_wall"] = waited
        if self.num_workers == 0:
            out["verdict"] = (f"decoding took {100 * seconds / wall:.0f}% of the training time in the training "
                              "process (data.num_workers > 0 moves it to worker processes)")
        elif waited is not None and waited > 0.2:
            out["verdict"] = (f"input-bound: training waited for batches {100 * waited:.0f}% of the time, though "
                              f"{workers} workers decode {per_process * workers:,.0f}/s (the workers start again "
                              "each epoch: on a small dataset that start is a large part of an epoch)")
        elif images / wall > 0.8 * per_process * workers:
            out["verdict"] = (f"input-bound: training took images at {images / wall:,.0f}/s, {100 * images / wall / (per_process * workers):.0f}% "
                              f"of what {workers} workers decode ({per_process * workers:,.0f}/s): raise data.num_workers")
        else:
            out["verdict"] = (f"compute-bound: training took images at {images / wall:,.0f}/s, {workers} workers "
                              f"could decode {per_process * workers:,.0f}/s"
                              + (f", and it waited for batches {100 * waited:.0f}% of the time" if waited is not None
                                 else ""))
        return out


def write_digits_folder(root: str | Path, image_size: int = 32, *, val_fraction: float = 0.2, seed: int = 0,
                        extension: str = "png") -> dict[str, int]:
    """Write the package's 1,797 8x8 digits, upsampled to ``image_size`` (bicubic), as
    ``root/train/<digit>/<i>.<extension>`` and ``root/val/<digit>/<i>.<extension>`` (a seeded random
    `val_fraction` of them in val). Returns the images written per split. A folder already holding
    other files there (an earlier call's in another format or split) is refused: they would be read
    as more images."""
    from . import digits

    Image = _pil()
    images, labels = digits().tensors
    pixels = (images.view(-1, 8, 8) * 255).round().to(torch.uint8).numpy()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(len(order) * val_fraction)
    paths = [Path(root) / ("val" if k < n_val else "train") / str(int(labels[i])) / f"{i:04d}.{extension}"
             for k, i in enumerate(order)]
    others = sorted({f for split in ("train", "val") for f in (Path(root) / split).rglob("*") if f.is_file()}
                    - set(paths))
    if others:
        raise FileExistsError(f"{str(root)!r} already holds {len(others)} other files (e.g. {str(others[0])!r}): "
                              "remove them or write to another folder")
    counts = {"train": 0, "val": 0}
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(pixels[int(path.stem)]).resize((image_size, image_size), Image.BICUBIC)
        img.save(path)
        counts[path.parts[-3]] += 1
    return counts
