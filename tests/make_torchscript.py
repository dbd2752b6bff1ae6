"""Writes TorchScript modules for memfit's tests with Debian's python3-torch.

Usage: python3 tests/make_torchscript.py OUT_DIR
  OUT_DIR/resnet18.pt        torchvision's resnet18 (weights=None, 1 input
                             channel, 10 classes) as an nn.Sequential of its
                             children with a Flatten before fc: a chain.
  OUT_DIR/resnet18_whole.pt  the ResNet itself, whose forward flattens
                             between its children: not a chain.
  OUT_DIR/blocks.pt          memfit's make_resnet (width 16, 3 stages of 3
                             blocks, out-of-place ReLUs) written in Python,
                             bench/peers.py's make_chain: residual blocks whose
                             relu(y + shortcut) TorchScript's profiling
                             executor would differentiate itself.
  OUT_DIR/wrong_input.pt     a chain whose Linear takes 100 features, not an
                             image's 784: its forward fails on any batch.
  OUT_DIR/two_only.pt        a chain whose first child works on batches of 2
                             only: it fails inside training, not on loading.
"""
import os
import sys

import torch
import torchvision
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from peers import make_chain  # noqa: E402  one definition of the CNN for peers.py, tax.py and the tests



class TwoOnly(nn.Module):
    """Multiplies by ones expanded from 2 examples: other batch sizes fail."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.ones(2, 1, 1, 1).expand(x.size(0), 1, 1, 1)


out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
resnet = torchvision.models.resnet18(weights=None, num_classes=10)
resnet.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
chain = nn.Sequential(*list(resnet.children())[:-1], nn.Flatten(), resnet.fc)
torch.jit.script(chain).save(os.path.join(out, "resnet18.pt"))
torch.jit.script(resnet).save(os.path.join(out, "resnet18_whole.pt"))
blocks = make_chain()
torch.jit.script(blocks).save(os.path.join(out, "blocks.pt"))
torch.jit.script(nn.Sequential(nn.Flatten(), nn.Linear(100, 10))).save(os.path.join(out, "wrong_input.pt"))
torch.jit.script(nn.Sequential(TwoOnly(), nn.Flatten(), nn.Linear(784, 10))).save(os.path.join(out, "two_only.pt"))
print("wrote", out)
