"""`text_lm`: a small decoder-only Transformer language model (GPT-style, pre-layer-norm) on a
local UTF-8 text file, at the byte or the character level.

The text becomes one sequence of tokens: its UTF-8 bytes (256 tokens), or its characters
(one token per distinct character of the file, in code-point order). The first
`1 − test_fraction` of the sequence trains, the rest tests (a split by position, so no test
text is seen in training). Each example is `context` consecutive tokens (x) and the same
window shifted by one (y), windows side by side without overlap.

Metrics: `test_loss` is the mean cross-entropy per token (nats), `test_perplexity` its
exponential, and `test_accuracy` the share of tokens predicted right (next-token accuracy),
so `compare` and `plot` work as for classifiers.

Parameters (V tokens, C context, L layers, width d; the output layer shares the embedding's
weights): V·d + C·d + L·(12·d² + 13·d) + 2·d. Per layer: two layer norms (4d), the attention's
query/key/value and output projections (4d² + 4d) and the MLP d → 4d → d (8d² + 5d).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from dsgd_cli.api import Task, TaskData, option


def lm_params(vocab: int, context: int, layers: int, width: int) -> int:
    """The model's parameter count (see the module's text)."""
    return vocab * width + context * width + layers * (12 * width**2 + 13 * width) + 2 * width


@lru_cache(maxsize=4)
def _tokens(path: str, level: str, signature: tuple) -> tuple[torch.Tensor, tuple[str, ...] | None]:
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"path: {path} is not UTF-8 text (byte 0x{data[error.start]:02x} at "
                         f"offset {error.start})") from None
    if level == "byte":
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), None
    alphabet = tuple(sorted(set(text)))
    index = {char: i for i, char in enumerate(alphabet)}
    return torch.tensor([index[char] for char in text], dtype=torch.long), alphabet


def read_tokens(path: str, level: str) -> tuple[torch.Tensor, int]:
    """The file's tokens and the vocabulary size; read once per process while the file is
    unchanged. ValueError naming the path when it cannot be read or is not UTF-8."""
    try:
        stat = Path(path).stat()
        if not Path(path).is_file():
            raise ValueError(f"path: {path} is not a file")
        tokens, alphabet = _tokens(path, level, (stat.st_size, stat.st_mtime_ns))
    except OSError as error:
        raise ValueError(f"path: cannot read {path}: {error.strerror or error}") from None
    return tokens, 256 if alphabet is None else len(alphabet)


def windows(tokens: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Side-by-side windows: x = tokens[i·C : (i+1)·C], y = the same shifted by one token."""
    count = (len(tokens) - 1) // context
    x = tokens[: count * context].view(count, context)
    y = tokens[1: count * context + 1].view(count, context)
    return x, y


@dataclass
class TextLMOptions:
    path: str = option(help="a UTF-8 text file (relative: to the working directory, else $DSGD_DATA)")
    level: Literal["byte", "char"] = option("byte", help="tokens: UTF-8 bytes or characters")
    layers: int = option(2, min=1, max=256, help="Transformer blocks")
    width: int = option(128, min=1, max=65536, help="model width d (a multiple of heads)")
    heads: int = option(4, min=1, max=1024, help="attention heads")
    context: int = option(64, min=1, max=65536, help="tokens per example")
    test_fraction: float = option(0.1, min=0.01, max=0.5, help="share of the text, at its end, held out")

    def __post_init__(self):
        if self.width % self.heads:
            raise ValueError(f"width: {self.width} is not a multiple of heads ({self.heads})")
        # Read when the spec is checked: a missing or unreadable file stops `dsgd run`
        # before anything launches, and the run's configuration records the absolute path.
        self.path = str(locate(self.path))
        tokens, _ = read_tokens(self.path, self.level)
        split = split_point(len(tokens), self.test_fraction)
        for part, length in (("training", split), ("test", len(tokens) - split)):
            if length - 1 < self.context:
                raise ValueError(f"path: {self.path} is too short: its {part} part has "
                                 f"{length} tokens, fewer than context + 1 ({self.context + 1})")


def locate(path: str) -> Path:
    """`path` as written (a relative one from the working directory), or, when there is
    nothing there, relative to `$DSGD_DATA`, where data sets are kept (as for CIFAR)."""
    given = Path(path).expanduser()
    root = os.environ.get("DSGD_DATA")
    if not given.is_absolute() and not _exists(given) and root:
        in_data = Path(root).expanduser() / given
        if _exists(in_data):
            return in_data.resolve()
    return given.resolve()


def _exists(path: Path) -> bool:
    """Whether something is at `path`; False for a name the system refuses (one too long),
    which `read_tokens` then reports as a path it cannot read."""
    try:
        return path.exists()
    except OSError:
        return False


def split_point(length: int, test_fraction: float) -> int:
    """Tokens before this index train, the rest test."""
    return length - int(length * test_fraction)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d/heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # each token sees its past
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Tokens (B, T) → next-token logits (B, T, vocab)."""

    def __init__(self, vocab: int, context: int, layers: int, width: int, heads: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.embedding(tokens) + self.position(positions))
        return self.norm(x) @ self.embedding.weight.T  # the output layer is the embedding


class TextLM(Task):
    """`text_lm`."""

    Options = TextLMOptions
    reports_perplexity = True
    one_label_per_example = False  # a target is a window of tokens

    def _data(self) -> tuple[torch.Tensor, int]:
        return read_tokens(self.options.path, self.options.level)

    def load_data(self, seed: int) -> TaskData:
        tokens, _ = self._data()
        split = split_point(len(tokens), self.options.test_fraction)
        train_x, train_y = windows(tokens[:split], self.options.context)
        test_x, test_y = windows(tokens[split:], self.options.context)
        return TaskData(train_x, train_y, test_x, test_y)

    def train_examples(self) -> int:
        tokens, _ = self._data()
        split = split_point(len(tokens), self.options.test_fraction)
        return (split - 1) // self.options.context

    def vocabulary(self) -> int:
        return self._data()[1]

    def build_model(self) -> nn.Module:
        o = self.options
        return TransformerLM(self.vocabulary(), o.context, o.layers, o.width, o.heads)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy per token."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def count_correct(self, output: torch.Tensor, target: torch.Tensor) -> float:
        """Per example, the share of its tokens predicted right: summed over examples and
        divided by their number, the next-token accuracy (all examples are equally long)."""
        return float((output.argmax(dim=-1) == target).float().mean(dim=1).sum())
