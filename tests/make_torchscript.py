"""Writes TorchScript modules for memfit's tests with Debian's python3-torch.

Usage: python3 tests/make_torchscript.py OUT_DIR
  OUT_DIR/resnet18.pt        torchvision's resnet18 (weights=None, 1 input
                             channel, 10 classes) as an nn.Sequential of its
                             children with a Flatten before fc: a chain.
  OUT_DIR/resnet18_whole.pt  the ResNet itself, whose forward flattens
                             between its children: not a chain.
  OUT_DIR/blocks.pt          memfit's make_resnet (width 16, 3 stages of 3
                             blocks, out-of-place ReLUs) written in Python,
                             as bench/peers.py's CNN: residual blocks whose
                             relu(y + shortcut) TorchScript's profiling
                             executor would differentiate itself.
"""
import os
import sys

import torch
import torchvision
from torch import nn

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
resnet = torchvision.models.resnet18(weights=None, num_classes=10)
resnet.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
chain = nn.Sequential(*list(resnet.children())[:-1], nn.Flatten(), resnet.fc)
torch.jit.script(chain).save(os.path.join(out, "resnet18.pt"))
torch.jit.script(resnet).save(os.path.join(out, "resnet18_whole.pt"))


class Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


layers = [nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
c = 16
for stage, stride in enumerate([1, 2, 2]):
    for b in range(3):
        layers.append(Block(c, 16 * 2**stage, stride if b == 0 else 1))
        c = 16 * 2**stage
blocks = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
torch.jit.script(blocks).save(os.path.join(out, "blocks.pt"))
print("wrote", out)
