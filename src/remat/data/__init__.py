"""The text corpus shipped with remat, for the demo and ``remat train --model gpt``.

``corpus.txt`` is about 68 KB of plain English prose from CPython's own documentation (see
``build_corpus.py``), folded to printable ASCII. :class:`CharCorpus` turns it into
character-level next-token batches: inputs ``x[b, t]`` and targets ``y[b, t] = x[b, t + 1]``
as int64 token ids, drawn at random offsets from a train or held-out split.
"""
from __future__ import annotations

from importlib import resources

import torch

CORPUS_FILE = "corpus.txt"


def load_corpus() -> str:
    """The shipped corpus text (package data of ``remat.data``)."""
    return resources.files(__name__).joinpath(CORPUS_FILE).read_text(encoding="ascii")


class CharCorpus:
    """Character-level tokenisation of a text and random next-character batches from it.

    The vocabulary is the sorted set of characters of the text, so ids are stable for a given
    text. The last ``holdout`` fraction of the text is the validation split, never trained on.
    """

    def __init__(self, text: str | None = None, holdout: float = 0.1):
        text = load_corpus() if text is None else text
        if not 0 <= holdout < 1:
            raise ValueError(f"holdout must be a fraction in [0, 1), got {holdout}")
        self.chars: list[str] = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}
        ids = self.encode(text)
        cut = int(len(ids) * (1 - holdout))
        self.splits = {"train": ids[:cut], "val": ids[cut:]}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64) of ``text``; every character must be in the vocabulary."""
        try:
            return torch.tensor([self._index[c] for c in text], dtype=torch.int64)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the corpus vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator,
              split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, each ``[batch_size, seq_len]`` int64: windows at random offsets of
        ``split`` and the same windows shifted by one character (the next-token targets)."""
        data = self.splits[split]
        if len(data) <= seq_len + 1:
            raise ValueError(f"the {split} split has {len(data)} characters, too few for windows of {seq_len + 1}")
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len + 1)
        windows = data[starts[:, None] + offsets[None, :]]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
