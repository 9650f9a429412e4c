"""Example models written in vanilla PyTorch (nothing remat-specific), with factories that build
a model, example inputs and a loss function at a chosen size.

Each ``make_<name>(size, dtype)`` returns ``(model, example_inputs, loss_fn)`` where
``example_inputs`` is the model's inputs followed by the loss targets, and ``loss_fn(output,
*targets)`` gives a scalar: ``loss_fn(model(*example_inputs[:-n]), *example_inputs[-n:])`` with
``n = len(signature(loss_fn).parameters) - 1``. Sizes: ``"tiny"`` runs a step in milliseconds
(tests), ``"small"`` has tens of MB of activations (demo and benchmarks on a 2-core CPU).
``make_gpt`` also has ``"medium"``: the speed benchmark's 8-layer GPT (about 1 GB of activations).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Example = tuple[nn.Module, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]

SIZES = ("tiny", "small")


def _check_size(size: str, sizes: tuple[str, ...] = SIZES) -> None:
    if size not in sizes:
        raise ValueError(f"unknown model size {size!r}; valid sizes: {', '.join(sizes)}")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(batch: int | None, default: int) -> int:
    """The batch size: the size's default, or a positive override (activations grow with it, parameters do not)."""
    if batch is None:
        return default
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    return batch


# ---------------------------------------------------------------- MLP
class MLP(nn.Module):
    """Fully connected classifier: Linear → ReLU repeated, then a linear head."""

    def __init__(self, in_features: int, hidden: int, depth: int, classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of class logits ``[N, C, ...]`` against integer targets ``[N, ...]``."""
    return F.cross_entropy(logits, target)


def make_mlp(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0, batch: int | None = None) -> Example:
    """An MLP classifier on random features. tiny: 8×32 → 64×2 → 10; small: 512×784 → 1024×4 → 10.
    ``batch`` overrides the size's batch (more activation memory per parameter byte)."""
    _check_size(size)
    default_batch, fin, hidden, depth, classes = (8, 32, 64, 2, 10) if size == "tiny" else (512, 784, 1024, 4, 10)
    batch = _batch(batch, default_batch)
    torch.manual_seed(seed)
    model = MLP(fin, hidden, depth, classes).to(dtype)
    g = _generator(seed + 1)
    x = torch.randn(batch, fin, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (batch,), generator=g)
    return model, (x, y), classification_loss


# ---------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    """Two 3×3 conv-BN layers with an identity (or 1×1-conv projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet: conv stem, max pool, stages of basic blocks, global average pool, linear head."""

    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, classes: int, in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        stages = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks = [BasicBlock(cin, w, 1 if i == 0 else 2)]
            blocks += [BasicBlock(w, w, 1) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = w
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_resnet(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0, batch: int | None = None) -> Example:
    """A ResNet classifier on random images. tiny: 4×3×16×16, widths 8,16; small: 16×3×32×32, widths 32,64,128 (2 blocks each).
    ``batch`` overrides the size's batch."""
    _check_size(size)
    if size == "tiny":
        default_batch, hw, widths, nblocks, classes = 4, 16, (8, 16), 1, 10
    else:
        default_batch, hw, widths, nblocks, classes = 16, 32, (32, 64, 128), 2, 10
    batch = _batch(batch, default_batch)
    torch.manual_seed(seed)
    model = ResNet(widths, nblocks, classes).to(dtype)
    g = _generator(seed + 1)
    x = torch.randn(batch, 3, hw, hw, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (batch,), generator=g)
    return model, (x, y), classification_loss


# ---------------------------------------------------------------- GPT
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out with matmuls, a triangular mask and softmax."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with a GELU MLP."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, transformer blocks, final layer norm and a
    language-model head whose weight is the token embedding (weight tying, unless ``tie=False``)."""

    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float = 0.1,
                 tie: bool = True):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[GPTBlock(n_embd, n_head, block_size, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = self.ln_f(self.blocks(x))
        return self.lm_head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits ``[B, T, V]`` against token ids ``[B, T]``."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_gpt(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0, dropout: float = 0.1,
             batch: int | None = None) -> Example:
    """A GPT on random tokens. tiny: 2×16 tokens, 2 layers, 2 heads, width 32, vocab 64;
    small: 8×64 tokens, 4 layers, 4 heads, width 128, vocab 512; medium (the speed benchmark's
    "GPT medium"): 8×256 tokens, 8 layers, 8 heads, width 512, vocab 8000, untied head, no
    dropout. ``batch`` overrides the size's batch."""
    _check_size(size, SIZES + ("medium",))
    tie = True
    if size == "tiny":
        default_batch, T, vocab, n_layer, n_head, n_embd = 2, 16, 64, 2, 2, 32
    elif size == "small":
        default_batch, T, vocab, n_layer, n_head, n_embd = 8, 64, 512, 4, 4, 128
    else:
        default_batch, T, vocab, n_layer, n_head, n_embd = 8, 256, 8000, 8, 8, 512
        dropout, tie = 0.0, False
    batch = _batch(batch, default_batch)
    torch.manual_seed(seed)
    model = GPT(vocab, T, n_layer, n_head, n_embd, dropout, tie=tie).to(dtype)
    g = _generator(seed + 1)
    idx = torch.randint(0, vocab, (batch, T), generator=g)
    targets = torch.randint(0, vocab, (batch, T), generator=g)
    return model, (idx, targets), lm_loss


# ---------------------------------------------------------------- U-Net
class DoubleConv(nn.Module):
    """(3×3 conv → batch norm → ReLU) twice."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNet(nn.Module):
    """A U-Net: a down path of double convs and max pools, an up path of transposed convs that
    concatenates the matching down-path activation (long skips), and a 1×1 conv to class logits."""

    def __init__(self, in_channels: int, classes: int, base: int, depth: int):
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([DoubleConv(in_channels, widths[0])])
        self.down.extend(DoubleConv(widths[i], widths[i + 1]) for i in range(depth))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in reversed(range(depth)))
        self.up_conv = nn.ModuleList(DoubleConv(2 * widths[i], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        x = self.down[0](x)
        for layer in self.down[1:]:
            skips.append(x)
            x = layer(self.pool(x))
        for up, conv in zip(self.up, self.up_conv):
            x = conv(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


def make_unet(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0, batch: int | None = None) -> Example:
    """A U-Net segmenter on random images with per-pixel class targets. tiny: 2×3×16×16, base 4,
    depth 2; small: 4×3×64×64, base 16, depth 3. ``batch`` overrides the size's batch."""
    _check_size(size)
    default_batch, hw, base, depth, classes = (2, 16, 4, 2, 3) if size == "tiny" else (4, 64, 16, 3, 4)
    batch = _batch(batch, default_batch)
    torch.manual_seed(seed)
    model = UNet(3, classes, base, depth).to(dtype)
    g = _generator(seed + 1)
    x = torch.randn(batch, 3, hw, hw, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (batch, hw, hw), generator=g)
    return model, (x, y), classification_loss


MODELS: dict[str, Callable[..., Example]] = {"mlp": make_mlp, "resnet": make_resnet, "gpt": make_gpt, "unet": make_unet}


def make(name: str, size: str = "tiny", dtype: torch.dtype = torch.float32, **kwargs) -> Example:
    """Build a zoo model by name: one of ``MODELS``."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}") from None
    return factory(size, dtype, **kwargs)
