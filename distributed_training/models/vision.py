"""Image classifiers of the published layouts: ResNet-18/50 and ViT-S/16, ViT-B/16 (our own definitions).

* **ResNet** (He et al. 2016, in the "v1.5" form torchvision and MLPerf train: the stride of a
  Bottleneck is on its 3x3 convolution). A 7x7 stride-2 stem and a 3x3 max-pool, four stages of
  BasicBlocks (ResNet-18: 2, 2, 2, 2) or Bottlenecks (ResNet-50: 3, 4, 6, 3, expansion 4), global
  average pooling, one linear head. Each block's last BatchNorm can start at gamma = 0
  (`zero_init_residual`, Goyal et al. 2017): every residual block is then the identity at
  initialisation, which helps large-batch training.
* **ViT** (Dosovitskiy et al. 2021): the image cut into 16x16 patches by one strided convolution, a
  learned class token and position embeddings, pre-norm transformer blocks (LayerNorm -> attention
  -> residual, LayerNorm -> MLP (4x, GELU) -> residual), a final LayerNorm and a linear head on the
  class token. Attention goes through `scaled_dot_product_attention`.

Inputs are (B, 3, H, W) batches. A ``uint8`` batch (what `ImageFolder` yields, 4x smaller to move
between processes and to the GPU) is turned into floats here, on the model's device: scaled to
[0, 1] and normalised by the ImageNet mean and standard deviation. A floating-point batch is taken as
already normalised. With ``channels_last`` the input is put in NHWC memory order (the model's
weights should be too: ``model.to(memory_format=torch.channels_last)``), which tensor-core
convolutions prefer on GPUs.

Parameter counts at 1000 classes: ResNet-18 11,689,512; ResNet-50 25,557,032; ViT-S/16 22,050,664;
ViT-B/16 86,567,656 (the published figures; tests check them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ResNet", "ViT", "VISION_PRESETS", "VisionPreset", "build_vision_model", "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class _Inputs(nn.Module):
    """What both model families do with their input first: uint8 -> normalised float, memory order."""

    def __init__(self, channels_last: bool) -> None:
        super().__init__()
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"expected images of shape (batch, 3, height, width), got {tuple(x.shape)}")
        if x.dtype == torch.uint8:
            # (x / 255 - mean) / std as one multiply-add per channel, computed in float32.
            scale = torch.tensor([1.0 / (255.0 * s) for s in IMAGENET_STD], device=x.device).view(1, 3, 1, 1)
            shift = torch.tensor([-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)], device=x.device)
            x = torch.addcmul(shift.view(1, 3, 1, 1), x.float(), scale)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


# ---------------------------------------------------------------------------------------------- ResNet
def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (a 1x1 convolution where the shape changes)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv3x3(cin, width, stride), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, cout), nn.BatchNorm2d(cout)
        self.downsample = _shortcut(cin, cout, stride)

    def last_norm(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """1x1 down to `width`, 3x3 (carrying the stride), 1x1 up to 4 x `width`; a shortcut around them."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, width, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = _shortcut(cin, cout, stride)

    def last_norm(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """A ResNet of `block` (BasicBlock or Bottleneck) with `layers` blocks per stage.

    Args:
        block: the residual block class.
        layers: blocks in each of the four stages.
        num_classes: outputs of the head.
        width: channels of the first stage (64 in the published models; the later stages double it).
        zero_init_residual: start each block's last BatchNorm at gamma = 0.
        channels_last: feed the convolutions NHWC inputs.
    """

    def __init__(self, block: type, layers: tuple[int, ...], num_classes: int = 1000, *, width: int = 64,
                 zero_init_residual: bool = False, channels_last: bool = False) -> None:
        super().__init__()
        self.inputs = _Inputs(channels_last)
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        cin = width
        stages = []
        for i, n in enumerate(layers):
            stage_width = width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, stage_width, 2 if (i > 0 and j == 0) else 1))
                cin = stage_width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_norm().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inputs(x)                                          # (B, 3, H, W)
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)  # (B, width, H/4, W/4)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))   # (B, C, H/32, W/32)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))  # (B, classes)


# ------------------------------------------------------------------------------------------------- ViT
class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, h, T, d)
        y = F.scaled_dot_product_attention(q, k, v)  # every token sees every token (no mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ViTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), _Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), _Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A Vision Transformer classifying from its class token.

    Args:
        image_size: side of the (square) input images; a multiple of `patch_size`.
        patch_size: side of each patch (one token).
        dim: width of the tokens.
        depth: transformer blocks.
        heads: attention heads (`dim` must divide evenly).
        num_classes: outputs of the head.
        channels_last: feed the patch convolution NHWC inputs.
    """

    def __init__(self, image_size: int = 224, patch_size: int = 16, dim: int = 768, depth: int = 12, heads: int = 12,
                 num_classes: int = 1000, *, channels_last: bool = False) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.image_size, self.patch_size = image_size, patch_size
        tokens = (image_size // patch_size) ** 2
        self.inputs = _Inputs(channels_last)
        self.patch_embed = nn.Conv2d(3, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens + 1, dim))
        self.blocks = nn.ModuleList(ViTBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"ViT built for {self.image_size}x{self.image_size} images, got {tuple(x.shape[-2:])}")
        x = self.patch_embed(self.inputs(x))                     # (B, D, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)                         # (B, N, D)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed  # (B, N+1, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))                     # (B, classes)


# --------------------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class VisionPreset:
    """One published architecture.

    Attributes:
        family: "resnet" or "vit".
        layers: ResNet: blocks per stage.
        bottleneck: ResNet: Bottleneck blocks (else BasicBlock).
        dim, depth, heads, patch_size: ViT: token width, blocks, heads, patch side.
    """

    family: str
    layers: tuple[int, ...] = ()
    bottleneck: bool = False
    dim: int = 0
    depth: int = 0
    heads: int = 0
    patch_size: int = 16


VISION_PRESETS = {
    "resnet18": VisionPreset("resnet", layers=(2, 2, 2, 2)),
    "resnet50": VisionPreset("resnet", layers=(3, 4, 6, 3), bottleneck=True),
    "vit_s16": VisionPreset("vit", dim=384, depth=12, heads=6),
    "vit_b16": VisionPreset("vit", dim=768, depth=12, heads=12),
}


def build_vision_model(preset: str, num_classes: int = 1000, image_size: int = 224, *, width: int | None = None,
                       depth: int | None = None, dim: int | None = None, zero_init_residual: bool = False,
                       channels_last: bool = False) -> nn.Module:
    """A model of `preset` (a key of `VISION_PRESETS`), optionally narrowed or made shallower.

    `width` (ResNets: the first stage's channels, 64 published) and `depth` / `dim` (ViTs: blocks and
    token width) override the preset's shape, for small runs; `zero_init_residual` applies to ResNets.
    With `channels_last` the model's weights are put in NHWC order too."""
    if preset not in VISION_PRESETS:
        raise ValueError(f"preset must be one of {', '.join(VISION_PRESETS)}, got {preset!r}")
    p = VISION_PRESETS[preset]
    if p.family == "resnet":
        if depth is not None or dim is not None:
            raise ValueError(f"{preset} is a ResNet: its shape is set by width, not depth / dim")
        model: nn.Module = ResNet(Bottleneck if p.bottleneck else BasicBlock, p.layers, num_classes,
                                  width=width or 64, zero_init_residual=zero_init_residual,
                                  channels_last=channels_last)
    else:
        if width is not None:
            raise ValueError(f"{preset} is a ViT: its shape is set by depth and dim, not width")
        model = ViT(image_size, p.patch_size, dim or p.dim, depth or p.depth, p.heads, num_classes,
                    channels_last=channels_last)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
