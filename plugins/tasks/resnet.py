"""The CIFAR ResNets of He et al. (2016), "Deep Residual Learning for Image Recognition",
section 4.2, in plain torch.

Depth 6n + 2: a 3×3 convolution of 16 channels, three stages of n basic blocks (two 3×3
convolutions each, with batch norm) of 16, 32 and 64 channels on 32×32, 16×16 and 8×8 maps,
global average pooling and a linear classifier. Where a stage halves the map and doubles the
channels, the shortcut is the paper's option A: the input subsampled by 2 and zero-padded to
the new channel count, so shortcuts add no parameters (ResNet-20: 0.27M parameters, as
published). Weights are initialised as in He et al. (2015), "Delving Deep into Rectifiers".
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# Published test accuracy on CIFAR-10 (He et al. 2016, table 6) and parameters, by depth.
PUBLISHED = {20: (0.9125, 0.27e6), 32: (0.9249, 0.46e6), 44: (0.9283, 0.66e6),
             56: (0.9303, 0.85e6), 110: (0.9357, 1.7e6)}


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.stride, self.extra_channels = stride, channels - in_channels

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """Option A: identity, or subsampled and zero-padded where the shape changes."""
        if self.stride != 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.extra_channels:
            x = F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """Takes uint8 images (N, 3, 32, 32) and normalises them itself with the data set's
    per-channel mean and standard deviation (of pixels scaled to [0, 1])."""

    def __init__(self, depth: int, classes: int, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"depth must be 6n + 2 (20, 32, 44, 56, 110), got {depth}")
        blocks = (depth - 2) // 6
        self.mean, self.std = mean, std  # constants, not buffers: nothing to average
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        stages, in_channels = [], 16
        for channels, stride in ((16, 1), (32, 2), (64, 2)):
            for index in range(blocks):
                stages.append(BasicBlock(in_channels, channels, stride if index == 0 else 1))
                in_channels = channels
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(64, classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=images.device).view(1, 3, 1, 1)
        return (images.float() / 255 - mean) / std

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(self.normalize(images))))
        x = self.stages(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
