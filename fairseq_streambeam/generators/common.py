"""Source preparation shared by the generators: lengths, limits, and encoding admitted subsets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from torch import Tensor

from ..search.penalties import source_max_len


@dataclass
class Sources:
    """One window (fairseq batch) of sources, with per-source facts known on the host."""

    net_input: dict
    lengths: List[int]  # tokens incl. EOS: fairseq's width of a lone source
    max_lens: List[int]
    sentence_ids: List[int]
    left_pad: bool
    pad: int

    @staticmethod
    def from_sample(sample, pad: int, max_len_a: float, max_len_b: int, model_max: int, min_len: int,
                    max_source_positions: int, match_source_len: bool = False) -> Sources:
        """The window's sources. `match_source_len`: each output has at most as many tokens as its
        source (fairseq's --match-source-len, which takes the batch's longest source instead)."""
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        n_src = src_tokens.size(0)
        lengths = src_tokens.ne(pad).sum(1).tolist()
        ids = sample.get("id")
        sentence_ids = ids.tolist() if isinstance(ids, Tensor) else list(range(n_src))
        for sid, n in zip(sentence_ids, lengths):
            if n > max_source_positions:
                raise ValueError(f"source {sid} has {n} tokens, more than the model's "
                                 f"{max_source_positions} source positions")
        if match_source_len:
            max_lens = list(lengths)  # fairseq reads net_input's src_lengths, EOS included
        else:
            max_lens = [source_max_len(n, max_len_a, max_len_b, model_max) for n in lengths]
        if max_lens and min_len > min(max_lens):
            raise ValueError(f"--min-len {min_len} exceeds the maximum length {min(max_lens)} allowed by "
                             + ("--match-source-len" if match_source_len else
                                "--max-len-a/--max-len-b and the model's positions"))
        left_pad = bool(src_tokens[:, 0].eq(pad).any()) if n_src else False
        return Sources(net_input, lengths, max_lens, sentence_ids, left_pad, pad)

    def __len__(self) -> int:
        return len(self.lengths)

    def subset_input(self, rows: List[int]) -> dict:
        """Encoder input for window rows `rows`, re-collated without the window's extra padding
        (the whole window is passed through untouched, as fairseq would encode it)."""
        if self.is_whole(rows):
            return self.net_input
        src = self.net_input["src_tokens"]
        idx = torch.tensor(rows, device=src.device)
        width = max(self.lengths[i] for i in rows)
        toks = src.index_select(0, idx)
        toks = toks[:, -width:] if self.left_pad else toks[:, :width]
        return {"src_tokens": toks, "src_lengths": toks.ne(self.pad).sum(1)}

    def is_whole(self, rows: List[int]) -> bool:
        """`rows` is the whole window in its own order (fairseq's batch as it came)."""
        return len(rows) == len(self) and all(i == r for i, r in enumerate(rows))

    def tokens(self, row: int) -> List[int]:
        """Source tokens of window row `row` (without padding, with EOS)."""
        t = self.net_input["src_tokens"][row]
        return t[t.ne(self.pad)].tolist()
