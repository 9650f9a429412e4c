"""A residual CNN no zoo model resembles (issue 46's reproducer): six conv-BN-ReLU blocks with skips
over 16x16 images, batch 32. Shared by ``test_budget_monotone.py`` and ``bench/budget_monotone.py``."""
from __future__ import annotations

import torch


class _Block(torch.nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))) + x


class ResidualCNN(torch.nn.Module):
    def __init__(self, c: int = 16, n: int = 6, classes: int = 10):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
        self.blocks = torch.nn.Sequential(*[_Block(c) for _ in range(n)])
        self.head = torch.nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))


def residual_cnn(seed: int = 0):
    """``(model, (images, labels), loss_fn)``, the same for the same seed."""
    torch.manual_seed(seed)
    model = ResidualCNN()
    return model, (torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))), torch.nn.functional.cross_entropy
