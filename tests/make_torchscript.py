"""Writes TorchScript modules for memfit's tests with Debian's python3-torch.

Usage: python3 tests/make_torchscript.py OUT_DIR
  OUT_DIR/resnet18.pt        torchvision's resnet18 (weights=None, 1 input
                             channel, 10 classes) as an nn.Sequential of its
                             children with a Flatten before fc: a chain.
  OUT_DIR/resnet18_whole.pt  the ResNet itself, whose forward flattens
                             between its children: not a chain.
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
print("wrote", out)
