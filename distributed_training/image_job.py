"""`dtrain`'s image-classification recipe: a ResNet / ViT preset trained on an image folder.

    model: {preset: resnet50, image_size: 224, channels_last: true, zero_init_residual: true}
    data:  {dataset: image_folder, root: /data/imagenet/train, val_root: /data/imagenet/val, num_workers: 8}
    training: {precision: bf16, label_smoothing: 0.1}

What the config's image fields mean is checked here (`check_config`, each error naming the field),
the datasets and the model are built here (`build_image_job`), and `input_watch` tells after training
whether the input pipeline or the model bounded it. See `models.vision` and `datasets.images`.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F

from .logs import get_logger

__all__ = ["build_image_job", "check_config", "classification_loss", "input_watch"]

log = get_logger("cli")


def check_config(cfg) -> None:
    """The rules between the image fields and the rest of the config (`JobConfig` calls it)."""
    from .config import ConfigError
    from .models import VISION_PRESETS

    m, d, t = cfg.model, cfg.data, cfg.training
    image = d.dataset == "image_folder"
    if not image:
        for name in ("root", "val_root"):
            if getattr(d, name) is not None:
                raise ConfigError(f"data.{name} is the image folder of data.dataset 'image_folder', not "
                                  f"{d.dataset!r}: leave it out")
        if t.label_smoothing:
            if cfg.loss.target:
                raise ConfigError(f"training.label_smoothing is for dtrain's own cross-entropy, not loss.target "
                                  f"{cfg.loss.target}: give it to your loss (loss.kwargs: {{label_smoothing: "
                                  f"{t.label_smoothing}}})")
            # dtrain's cross-entropy is the loss of the digits classifier and of a user's model on the digits
            # (a user's model on a user's data computes its own loss, as does a GPT).
            if (m.target and d.target) or not (m.preset == "classifier" or d.dataset == "digits"):
                raise ConfigError("training.label_smoothing applies to dtrain's own cross-entropy (data.dataset digits "
                                  "or image_folder); " + ("a model on data.target without loss.target computes its own "
                                                          "loss" if m.target and d.target else "a GPT computes its own loss"))
        return
    if d.root is None:
        raise ConfigError("data.root is required with data.dataset 'image_folder' (a directory of root/<class>/<image>)")
    if m.target:  # the user's model on the folder's images: the image preset's fields do not apply
        return
    if m.preset not in VISION_PRESETS:
        raise ConfigError(f"model.preset {m.preset!r} is not an image classifier; data.dataset 'image_folder' takes "
                          f"{', '.join(VISION_PRESETS)} (or your own model: model.target)")
    preset = VISION_PRESETS[m.preset]
    if m.dropout:
        raise ConfigError(f"model.dropout is not used by the image preset {m.preset!r}: leave it at 0")
    if preset.family == "resnet":
        for name in ("n_layer", "n_embd"):
            if getattr(m, name) is not None:
                raise ConfigError(f"model.{name} shapes ViTs; {m.preset!r} is a ResNet (its width: model.width)")
    else:
        if m.width is not None or m.zero_init_residual:
            field = "width" if m.width is not None else "zero_init_residual"
            raise ConfigError(f"model.{field} applies to ResNets; {m.preset!r} is a ViT (model.n_layer, model.n_embd)")
        if m.image_size % preset.patch_size:
            raise ConfigError(f"model.image_size must be a multiple of {m.preset!r}'s patch size {preset.patch_size}, "
                              f"got {m.image_size}")
        if m.n_embd is not None and m.n_embd % preset.heads:
            raise ConfigError(f"model.n_embd must be a multiple of {m.preset!r}'s {preset.heads} attention heads, "
                              f"got {m.n_embd}")
    for name in ("pipeline_parallel_size", "tensor_parallel_size"):
        if getattr(t, name) > 1:
            raise ConfigError(f"training.{name} > 1 with the image preset {m.preset!r} is not supported by dtrain yet: "
                              "use a data-parallel strategy (ddp, zero1, zero2, zero3 / fsdp)")


def classification_loss(cfg):
    """Cross-entropy, with ``training.label_smoothing`` (a picklable callable)."""
    smoothing = cfg.training.label_smoothing
    return functools.partial(F.cross_entropy, label_smoothing=smoothing) if smoothing else F.cross_entropy


def build_image_job(cfg):
    """(model, train set, validation set, criterion) for ``data.dataset: image_folder``.

    The validation set is ``data.val_root`` (with the same classes) or, without it, a seeded
    ``data.val_fraction`` of ``data.root``; it is read with the evaluation transform. The model's head
    has ``model.num_classes`` outputs, by default the folder's number of classes."""
    import torch

    from .config import ConfigError
    from .datasets.images import EvalTransform, ImageFolder, TrainTransform
    from .models import build_vision_model

    m, d, t = cfg.model, cfg.data, cfg.training
    train_t = TrainTransform(m.image_size, d.min_crop_scale, d.hflip)
    eval_t = EvalTransform(m.image_size, d.crop_fraction)
    field = "data.root"
    try:
        train = ImageFolder(d.root, train_t)
        if d.val_root is not None:
            field = "data.val_root"
            val = ImageFolder(d.val_root, eval_t)
        else:
            train, val = train.split(d.val_fraction, t.seed, eval_t)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{field}: {err}") from None
    if val.classes != train.classes and len(val):
        missing, extra = sorted(set(train.classes) - set(val.classes)), sorted(set(val.classes) - set(train.classes))
        said = "; ".join(part for part in (
            f"data.val_root lacks {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}" if missing else "",
            f"it has {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}, which data.root lacks" if extra else "",
        ) if part) or "the same names in another order"
        raise ConfigError(f"data.val_root's classes ({len(val.classes)}) differ from data.root's ({len(train.classes)}): "
                          f"{said}. The class folders must be the same in both")
    num_classes = m.num_classes or len(train.classes)
    if num_classes < len(train.classes):
        raise ConfigError(f"model.num_classes ({num_classes}) is less than the {len(train.classes)} classes of "
                          f"data.root {d.root!r}")
    torch.manual_seed(t.seed)  # the same initial weights on every rank
    model = build_vision_model(m.preset, num_classes, m.image_size, width=m.width, depth=m.n_layer, dim=m.n_embd,
                               zero_init_residual=m.zero_init_residual, channels_last=m.channels_last)
    log.info("dtrain: image folder %s: %d classes, %s training and %s validation images at %dx%d, %d loader "
             "workers per rank", d.root, len(train.classes), f"{len(train):,}", f"{len(val):,}", m.image_size,
             m.image_size, d.num_workers)
    return model, train, val, classification_loss(cfg)


class _NoWatch:
    def report(self, waited_s: float | None = None) -> dict:
        return {}


class _Watch:
    def __init__(self, meter, num_workers: int) -> None:
        from .datasets.images import InputWatch

        self.watch = InputWatch(meter, num_workers)

    def report(self, waited_s: float | None = None) -> dict:
        """Log and return the rates; `waited_s`: the seconds the training loop waited for batches."""
        summary = self.watch.summary(waited_s)
        if summary and self.watch.num_workers == 0:  # no workers: the rate of the training process itself
            log.info("dtrain: input pipeline: %s images decoded in the training process (data.num_workers 0) at "
                     "%s/s while decoding; trained at %s images/s: %s", f"{summary['images']:,.0f}",
                     f"{summary['decoded_images_per_s_per_process']:,.0f}", f"{summary['trained_images_per_s']:,.0f}",
                     summary["verdict"])
        elif summary:
            log.info("dtrain: input pipeline: %s images decoded at %s/s per worker (%s/s with data.num_workers %d); "
                     "trained at %s images/s: %s", f"{summary['images']:,.0f}",
                     f"{summary['decoded_images_per_s_per_process']:,.0f}",
                     f"{summary['decode_capacity_images_per_s']:,.0f}", self.watch.num_workers,
                     f"{summary['trained_images_per_s']:,.0f}", summary["verdict"])
        return summary


def input_watch(train, cfg):
    """Started just before training; ``report()`` after it logs the decode and training rates of this
    rank (an image folder's; for other datasets it does nothing) and returns them."""
    meter = getattr(train, "meter", None)
    return _Watch(meter, cfg.data.num_workers) if meter is not None else _NoWatch()
