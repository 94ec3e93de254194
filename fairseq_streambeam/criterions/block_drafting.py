"""Training criterion of the GAD block drafter: `--criterion block_drafting`.

Each sentence gives `blocks_per_sentence` blocks at random prefix lengths (one encoder pass).
Glancing (GLAT, Qian et al. 2021, as in Ge et al. 2022): a pass without gradient counts each
block's wrong predictions; `glance_ratio` times that many mask slots get their gold tokens, and the
loss is label-smoothed cross-entropy on the other mask slots. Distillation is in the data
(train_drafter.sh). No `from __future__ import annotations`: fairseq reads the config's field types.
"""

from dataclasses import dataclass, field

import torch
from fairseq import metrics
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import FairseqDataclass

from ..models.block_drafter import training_blocks


@dataclass
class BlockDraftingConfig(FairseqDataclass):
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing epsilon"})
    glance_ratio: float = field(default=0.5, metadata={"help": "share of a block's errors revealed as gold "
                                                                "tokens before the trained pass (0 = no glancing)"})
    blocks_per_sentence: int = field(default=2, metadata={"help": "random prefix lengths drawn per sentence"})


@register_criterion("block_drafting", dataclass=BlockDraftingConfig)
class BlockDraftingCriterion(FairseqCriterion):
    def __init__(self, task, label_smoothing: float = 0.1, glance_ratio: float = 0.5, blocks_per_sentence: int = 2):
        super().__init__(task)
        if blocks_per_sentence < 1:
            raise ValueError(f"--blocks-per-sentence must be >= 1, got {blocks_per_sentence}")
        if not 0.0 <= glance_ratio <= 1.0:
            raise ValueError(f"--glance-ratio must be in [0, 1], got {glance_ratio}")
        self.eps = label_smoothing
        self.glance_ratio = glance_ratio
        self.reps = blocks_per_sentence
        d = task.target_dictionary
        self.bos, self.mask = d.eos(), d.unk()

    def forward(self, model, sample, reduce=True):
        k = model.draft_block_size
        net = sample["net_input"]
        enc = model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])
        target = sample["target"].repeat(self.reps, 1)
        enc = model.encoder.reorder_encoder_out(
            enc, torch.arange(sample["target"].size(0), device=target.device).repeat(self.reps))
        tokens, positions, block_pad, labels = training_blocks(target, self.padding_idx, self.bos, self.mask, k)
        valid = labels.ne(self.padding_idx)

        glanced = torch.zeros_like(valid)
        glancing = self.glance_ratio > 0 and model.training
        if glancing:
            with torch.no_grad():
                pred = model.draft_logits(enc, tokens, positions, block_pad, k).argmax(-1)
            wrong = (pred.ne(labels) & valid).sum(1)
            n_reveal = (wrong.float() * self.glance_ratio).long()
            score = torch.rand(labels.shape, device=labels.device).masked_fill(~valid, 2.0)
            rank = score.argsort(1).argsort(1)
            glanced = rank < n_reveal.unsqueeze(1)
            tail = tokens[:, -k:].masked_scatter(glanced, labels[glanced])
            tokens = torch.cat([tokens[:, :-k], tail], 1)

        logits = model.draft_logits(enc, tokens, positions, block_pad, k)
        lprobs = model.get_normalized_probs((logits, None), log_probs=True)
        scored = valid & ~glanced
        lab = labels.masked_fill(~scored, self.padding_idx)
        loss, nll = label_smoothed_nll_loss(lprobs.reshape(-1, lprobs.size(-1)), lab.reshape(-1), self.eps,
                                            ignore_index=self.padding_idx, reduce=reduce)
        n_scored = int(scored.sum())
        logging_output = {"loss": loss.data, "nll_loss": nll.data, "ntokens": n_scored,
                          "nsentences": target.size(0), "sample_size": n_scored}
        if not glancing:  # without revealed slots: draft tokens a strict verifier would accept per block
            hit = logits.argmax(-1).eq(labels) & valid
            logging_output["accepted"] = int(hit.long().cumprod(1).sum())
            logging_output["blocks"] = target.size(0)
        return loss, n_scored, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        n = sum(log.get("sample_size", 0) for log in logging_outputs)
        for name in ("loss", "nll_loss"):
            total = sum(log.get(name, 0) for log in logging_outputs)
            metrics.log_scalar(name, total / max(n, 1) / torch.log(torch.tensor(2.0)).item(), n, round=3)
        blocks = sum(log.get("blocks", 0) for log in logging_outputs)
        if blocks:
            acc = sum(log.get("accepted", 0) for log in logging_outputs)
            metrics.log_scalar("draft_accepted", acc / blocks, blocks, round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
