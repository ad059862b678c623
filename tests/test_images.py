"""The image-classification recipe: ResNet / ViT presets, the image folder reader and its transforms,
and `dtrain` on image folders (the digits written as PNGs, to a real accuracy)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from distributed_training.config import ConfigError, load_config
from distributed_training.datasets.images import (DecodeMeter, EvalTransform, ImageFolder, InputWatch,
                                                   TrainTransform, find_images, write_digits_folder)
from distributed_training.models.vision import IMAGENET_MEAN, IMAGENET_STD, build_vision_model

Image = pytest.importorskip("PIL.Image")

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}


# ------------------------------------------------------------------------------------------ models
@pytest.mark.parametrize("preset, published", [("resnet18", 11_689_512), ("resnet50", 25_557_032),
                                               ("vit_s16", 22_050_664), ("vit_b16", 86_567_656)])
def test_parameter_counts_are_the_published_ones(preset, published):
    with torch.device("meta"):
        model = build_vision_model(preset, 1000, 224)
    assert sum(p.numel() for p in model.parameters()) == published


def test_parameter_counts_match_timm_where_installed():
    timm = pytest.importorskip("timm")
    for ours, theirs in [("resnet18", "resnet18"), ("resnet50", "resnet50"), ("vit_s16", "vit_small_patch16_224"),
                         ("vit_b16", "vit_base_patch16_224")]:
        with torch.device("meta"):
            a, b = build_vision_model(ours), timm.create_model(theirs, pretrained=False)
        assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in b.parameters()), ours


@pytest.mark.parametrize("preset, shape", [("resnet18", {"width": 8}), ("resnet50", {"width": 4}),
                                           ("vit_s16", {"depth": 2, "dim": 48})])
def test_uint8_inputs_are_normalised_and_channels_last_computes_the_same(preset, shape):
    torch.manual_seed(0)
    model = build_vision_model(preset, 10, 32, **shape).eval()
    x = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    reference = (x.float() / 255 - mean) / std  # what a float input is taken to be already
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(out, model(reference), rtol=1e-5, atol=1e-5)
        nhwc = build_vision_model(preset, 10, 32, **shape, channels_last=True)
        nhwc.load_state_dict(model.state_dict())
        torch.testing.assert_close(nhwc.eval()(x), out, rtol=1e-4, atol=1e-4)
    assert out.shape == (3, 10)
    if preset.startswith("resnet"):
        assert nhwc.conv1.weight.is_contiguous(memory_format=torch.channels_last)


def test_zero_init_residual_makes_every_block_start_as_its_shortcut():
    torch.manual_seed(0)
    model = build_vision_model("resnet50", 10, 32, width=4, zero_init_residual=True).eval()
    block = model.layer1[1]  # no downsample: the identity shortcut
    x = torch.relu(torch.randn(2, 16, 8, 8))
    with torch.no_grad():
        torch.testing.assert_close(block(x), x)  # relu(0 + x) = x for x >= 0
    plain = build_vision_model("resnet50", 10, 32, width=4).eval()
    with torch.no_grad():
        assert not torch.allclose(plain.layer1[1](x), x)


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="image_size"):
        build_vision_model("vit_b16", 10, 40)
    with pytest.raises(ValueError, match="preset"):
        build_vision_model("resnet34")
    model = build_vision_model("vit_s16", 10, 32, depth=1, dim=48)
    with pytest.raises(ValueError, match="32x32"):
        model(torch.zeros(1, 3, 48, 48, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------- dataset
def _folder(root: Path, classes=("b_dog", "a_cat", "c_eel"), per_class=3, size=(20, 12)) -> Path:
    for c, name in enumerate(classes):
        for i in range(per_class):
            folder = root / name / ("sub" if i == 2 else "")
            folder.mkdir(parents=True, exist_ok=True)
            value = 40 * c + 10 * i
            Image.new("RGB", size, (value, value + 1, value + 2)).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
    (root / "a_cat" / "notes.txt").write_text("not an image")
    return root


def test_image_folder_classes_sorted_and_every_image_found(tmp_path):
    root = _folder(tmp_path / "imgs")
    classes, samples = find_images(root)
    assert classes == ["a_cat", "b_dog", "c_eel"]
    assert [label for _, label in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # sub-directories included, txt not
    ds = ImageFolder(root, EvalTransform(8, 1.0))
    x, y = ds[4]
    assert x.dtype == torch.uint8 and x.shape == (3, 8, 8) and y == 1
    assert x[1, 4, 4].item() == 40 * 0 + 10 * 1 + 1  # b_dog (written first), image 1, green: a lossless PNG
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_images(tmp_path / "missing")
    (tmp_path / "empty" / "x").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images"):
        find_images(tmp_path / "empty")


def test_eval_transform_is_exact_and_deterministic(tmp_path):
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (24, 24, 3), generator=g, dtype=torch.uint8)
    img = Image.fromarray(pixels.numpy())
    # At the model's size with crop_fraction 1: the pixels themselves.
    assert torch.equal(EvalTransform(24, 1.0)(img), pixels.permute(2, 0, 1))
    # A 40x60 portrait image, 16 pixels: shorter side to round(16 / 0.8) = 20 (20x30), central 16x16 at (2, 7).
    tall = Image.fromarray(torch.randint(0, 256, (60, 40, 3), generator=g, dtype=torch.uint8).numpy())
    out = EvalTransform(16, 0.8)(tall)
    resized = torch.from_numpy(np.array(tall.resize((20, 30), Image.BILINEAR))).permute(2, 0, 1)
    assert torch.equal(out, resized[:, 7:23, 2:18])
    assert torch.equal(out, EvalTransform(16, 0.8)(tall))
    # The resize itself agrees with torch's antialiased bilinear (an independent implementation) to rounding.
    ref = torch.nn.functional.interpolate(torch.from_numpy(np.array(tall)).permute(2, 0, 1)[None].float(),
                                          size=(30, 20), mode="bilinear", antialias=True, align_corners=False)[0]
    assert (ref[:, 7:23, 2:18] - out.float()).abs().max() <= 2


def test_train_transform_crops_flips_and_keeps_the_range():
    g = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (16, 16, 3), generator=g, dtype=torch.uint8)
    img = Image.fromarray(pixels.numpy())
    torch.manual_seed(0)
    # Area 1 of a square image: the whole image, flipped or not.
    whole = [TrainTransform(16, min_scale=1.0)(img) for _ in range(20)]
    plain, mirrored = pixels.permute(2, 0, 1), pixels.permute(2, 0, 1).flip(-1)
    assert all(torch.equal(x, plain) or torch.equal(x, mirrored) for x in whole)
    assert any(torch.equal(x, plain) for x in whole) and any(torch.equal(x, mirrored) for x in whole)
    assert all(torch.equal(x, plain) for x in (TrainTransform(16, 1.0, hflip=False)(img) for _ in range(5)))
    t = TrainTransform(12, min_scale=0.1)
    boxes = [t.crop_box(64, 48) for _ in range(200)]
    for left, top, right, bottom in boxes:
        w, h = right - left, bottom - top
        assert 0 <= left < right <= 64 and 0 <= top < bottom <= 48
        assert 0.1 * 64 * 48 * 0.9 <= w * h <= 64 * 48 and 3 / 4 * 0.85 <= w / h <= 4 / 3 * 1.15
    assert len(set(boxes)) > 150
    out = t(Image.fromarray(torch.randint(0, 256, (48, 64, 3), generator=g, dtype=torch.uint8).numpy()))
    assert out.shape == (3, 12, 12) and out.dtype == torch.uint8


def test_decoding_is_counted_in_the_worker_processes(tmp_path):
    ds = ImageFolder(_folder(tmp_path / "imgs", per_class=4), EvalTransform(8, 1.0))
    watch = InputWatch(ds.meter, num_workers=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2)
    assert sum(len(y) for _, y in loader) == 12
    summary = watch.summary()
    assert summary["images"] == 12 and summary["decode_capacity_images_per_s"] > 0
    assert "bound" in summary["verdict"]
    assert ds.meter.counts[0, 0] == 0 and ds.meter.counts[1:, 0].sum() == 12  # all in the workers' rows
    solo = DecodeMeter()
    solo.add(0.5)
    assert solo.totals() == (1.0, 0.5)
    # Told how long training waited for batches: most of the wall time is input-bound whatever the decode
    # rate (the workers' start each epoch, on a small dataset); little of it keeps the rate's verdict.
    import time

    time.sleep(0.05)
    wall = time.perf_counter() - watch.start
    waited = watch.summary(waited_s=0.9 * wall)
    assert waited["verdict"].startswith("input-bound: training waited for batches") and waited["waited_share_of_wall"] > 0.5
    assert not watch.summary(waited_s=0.0)["verdict"].startswith("input-bound: training waited")


@pytest.mark.parametrize("workers", [0, 2])
def test_the_input_pipeline_line_says_where_decoding_ran(tmp_path, caplog, workers):
    """With data.num_workers 0 the images are decoded in the training process: the line says so, with no
    rate "with the workers" (it once gave one, the same as the process's)."""
    import logging
    from types import SimpleNamespace

    from distributed_training.image_job import input_watch

    ds = ImageFolder(_folder(tmp_path / "imgs", per_class=4), EvalTransform(8, 1.0))
    watch = input_watch(ds, SimpleNamespace(data=SimpleNamespace(num_workers=workers)))
    assert sum(len(y) for _, y in torch.utils.data.DataLoader(ds, batch_size=3, num_workers=workers)) == 12
    caplog.set_level(logging.INFO, logger="distributed_training")
    assert watch.report()["images"] == 12
    line = next(r.getMessage() for r in caplog.records if "input pipeline" in r.getMessage())
    if workers:
        assert "12 images decoded at" in line and "per worker" in line and "with data.num_workers 2);" in line, line
        assert "bound" in line, line
    else:
        assert "12 images decoded in the training process (data.num_workers 0) at" in line, line
        assert "per worker" not in line and "with the" not in line and "per process" not in line, line
        assert "of the training time in the training process" in line, line


def test_digits_folder_is_written_split_and_readable(tmp_path):
    counts = write_digits_folder(tmp_path / "d", 16, val_fraction=0.2)
    assert counts == {"train": 1438, "val": 359}
    train = ImageFolder(tmp_path / "d" / "train", EvalTransform(16, 1.0))
    assert train.classes == [str(d) for d in range(10)] and len(train) == 1438
    x, _ = train[0]
    assert x.shape == (3, 16, 16) and x.max() > 100 and x.min() < 20  # ink on a dark background


def test_digits_folder_written_again_in_another_format_is_refused(tmp_path):
    """`make_digit_images.py` run again with --format jpg over a png folder added the jpgs beside the pngs:
    every digit twice (2,876 training images), silently. The same call again still just rewrites."""
    write_digits_folder(tmp_path / "d", 8)
    assert write_digits_folder(tmp_path / "d", 12) == {"train": 1438, "val": 359}  # another size: the same files
    with pytest.raises(FileExistsError, match=r"already holds 1797 other files .*\.png"):
        write_digits_folder(tmp_path / "d", 8, extension="jpg")
    assert len(list((tmp_path / "d" / "train").rglob("*.*"))) == 1438 and not list((tmp_path / "d").rglob("*.jpg"))


# ------------------------------------------------------------------------------------------ config
IMAGES = {"model": {"preset": "resnet18"}, "data": {"dataset": "image_folder", "root": "x"}}


def _with(**sections):
    raw = {k: dict(v) for k, v in IMAGES.items()}
    for section, fields in sections.items():
        raw.setdefault(section, {}).update(fields)
    return raw


@pytest.mark.parametrize("raw, field", [
    ({"model": {"preset": "resnet18"}}, "model.preset"),
    (_with(data={"root": None}), "data.root"),
    ({"data": {"dataset": "digits", "root": "x"}, "model": {"preset": "classifier"}}, "data.root"),
    (_with(model={"preset": "vit_b16", "image_size": 40}), "model.image_size"),
    (_with(model={"preset": "vit_s16", "width": 8}), "model.width"),
    (_with(model={"n_layer": 2}), "model.n_layer"),
    (_with(model={"preset": "vit_s16", "n_embd": 100}), "model.n_embd"),
    (_with(training={"label_smoothing": 1.0}), "training.label_smoothing"),
    ({"training": {"label_smoothing": 0.1}}, "training.label_smoothing"),
    (_with(data={"num_workers": -1}), "data.num_workers"),
    (_with(data={"min_crop_scale": 0}), "data.min_crop_scale"),
    (_with(training={"pipeline_parallel_size": 2}), "training.pipeline_parallel_size"),
    (_with(model={"dropout": 0.1}), "model.dropout"),
])
def test_invalid_image_config_names_the_field(raw, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(raw)


def test_label_smoothing_with_a_user_model_or_loss():
    """dtrain's cross-entropy (and its label smoothing) is the loss of a user's model on the digits too;
    with loss.target the smoothing belongs in loss.kwargs. Both used to be refused with "a GPT computes its
    own loss", the first wrongly."""
    cfg = load_config({"model": {"target": "my_pkg.models:build"}, "data": {"dataset": "digits"},
                       "training": {"label_smoothing": 0.1}})
    assert cfg.training.label_smoothing == 0.1
    with pytest.raises(ConfigError, match=re.escape("give it to your loss (loss.kwargs: {label_smoothing: 0.1})")):
        load_config({"model": {"target": "my_pkg.models:build"}, "data": {"target": "my_pkg.data:Shapes"},
                     "loss": {"target": "torch.nn:CrossEntropyLoss"}, "training": {"label_smoothing": 0.1}})
    with pytest.raises(ConfigError, match="data.target without loss.target computes its own loss"):
        load_config({"model": {"target": "my_pkg.models:build"}, "data": {"target": "my_pkg.data:Shapes"},
                     "training": {"label_smoothing": 0.1}})

def test_missing_folder_and_too_few_classes_name_the_field(tmp_path):
    from distributed_training.image_job import build_image_job

    with pytest.raises(ConfigError, match="data.root: .*does not exist"):
        build_image_job(load_config(_with(data={"root": str(tmp_path / "nope")})))
    root = _folder(tmp_path / "imgs")
    with pytest.raises(ConfigError, match="model.num_classes"):
        build_image_job(load_config(_with(data={"root": str(root)}, model={"num_classes": 2})))
    model, train, val, _ = build_image_job(load_config(_with(data={"root": str(root), "val_fraction": 0.34},
                                                             model={"width": 4, "image_size": 16})))
    assert (len(train), len(val), model.fc.out_features) == (6, 3, 3)
    assert {p for p, _ in train.samples}.isdisjoint(p for p, _ in val.samples)


def test_the_example_config_is_valid():
    cfg = load_config(str(REPO / "examples" / "configs" / "images_cpu.yaml"))
    assert cfg.model.preset == "resnet18" and cfg.data.dataset == "image_folder"


# ------------------------------------------------------------------------------------ dtrain runs
def _accuracy(cfg_path: Path) -> float:
    """Validation accuracy of the model dtrain wrote, computed here from the folder (not by dtrain)."""
    from distributed_training.image_job import build_image_job

    cfg = load_config(str(cfg_path))
    model, _, val, _ = build_image_job(cfg)
    model.load_state_dict(torch.load(cfg.output))
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        return (model.eval()(x).argmax(1) == y).float().mean().item()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dtrain_resnet_on_the_digits_as_images_reaches_97_percent(tmp_path, warm_python):
    """The example config as shipped, on the digits written at 32x32: >= 97% of the held-out images."""
    write_digits_folder(tmp_path / "digits", 32)
    config = yaml.safe_load((REPO / "examples" / "configs" / "images_cpu.yaml").read_text())
    config["data"].update(root=str(tmp_path / "digits" / "train"), val_root=str(tmp_path / "digits" / "val"))
    config["output"] = str(tmp_path / "model.pt")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    out = warm_python(["-m", "distributed_training", str(path)], cwd=REPO, env=ENV, timeout=200)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "finished at step 360" in log and "input pipeline: 11,504 images decoded" in log, log[-2000:]
    accuracy = _accuracy(path)
    assert accuracy >= 0.97, accuracy


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dtrain_zero3_on_two_ranks_trains_from_an_image_folder_with_workers(tmp_path, warm_torchrun):
    write_digits_folder(tmp_path / "digits", 16, val_fraction=0.1)
    config = {
        "model": {"preset": "resnet18", "width": 8, "image_size": 16, "channels_last": True},
        "data": {"dataset": "image_folder", "root": str(tmp_path / "digits" / "train"), "num_workers": 1,
                 "min_crop_scale": 0.9, "hflip": False, "crop_fraction": 1.0},
        "training": {"strategy": "zero3", "max_steps": 30, "batch_size": 16, "lr": 3e-3, "label_smoothing": 0.1},
        "logging": {"every": 10},
        "output": str(tmp_path / "model.pt"),
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    out = warm_torchrun("distributed_training", [str(path)], module=True, nproc=2, env=ENV, cwd=REPO, timeout=200)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "strategy zero3" in log and "world size 2" in log and "finished at step 30" in log, log[-3000:]
    assert re.search(r"input pipeline: [\d,]+ images decoded at [\d,]+/s per worker .*with data.num_workers 1\);",
                     log), log[-2000:]
    # The held-out 10% (val_fraction) evaluated by dtrain: well below chance's ln(10) = 2.30 after 30 steps.
    val_loss = float(re.search(r"validation loss ([\d.]+)", log).group(1))
    assert val_loss < 1.9, log[-2000:]
    state = torch.load(config["output"])
    assert state["fc.weight"].shape == (10, 64)  # the whole model, gathered from the shards


def test_hard_images_are_read_right_or_named(tmp_path):
    """A 16-bit grayscale PNG is scaled to 8 bits (Pillow's own conversion clips it to white); a file
    Pillow cannot decode is named in the error; an empty class directory is refused by name."""
    import numpy as np
    from PIL import Image

    from distributed_training.datasets.images import EvalTransform, ImageFolder, find_images

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ramp = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)  # 0 .. 65472
    Image.fromarray(ramp).save(tmp_path / "a" / "deep.png")
    assert Image.open(tmp_path / "a" / "deep.png").mode.startswith("I;16")
    (tmp_path / "b" / "broken.png").write_bytes(b"not an image")
    data = ImageFolder(str(tmp_path), transform=EvalTransform(32, 1.0))
    image, label = data[0]
    assert label == 0 and image.dtype == torch.uint8
    expected = torch.from_numpy((ramp.astype(np.int64) * 255 // 65535).astype(np.uint8))
    assert torch.equal(image[0], expected) and torch.equal(image[1], expected)  # gray in every channel
    with pytest.raises(OSError, match="cannot decode .*broken.png"):
        data[1]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="class directory 'empty' hold\\(s\\) no images"):
        find_images(tmp_path)
