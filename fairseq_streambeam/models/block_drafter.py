"""The GAD block drafter (Ge et al. 2022): `--arch block_drafter`, a fairseq transformer whose
decoder predicts the next k target tokens in one parallel pass.

Decoder input of one row: [BOS y1 .. yt] (causal as in the AR decoder, so the prefix can be cached)
then k mask slots that see the whole prefix and each other (`runtime.block_step.block_attn_mask`).
The mask token is <unk>, so the drafter's dictionary stays the verifier's. `--init-from` starts
training from an AR model's weights.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture
from torch import Tensor

from ..runtime.block_step import BlockDecoder
from ..spec import UsageError

logger = logging.getLogger("fairseq_streambeam")


@register_model("block_drafter")
class BlockDrafterModel(TransformerModel):
    """TransformerModel with a block-drafting decoder call; same modules, so AR weights load into it."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--draft-block-size", type=int, metavar="K",
                            help="mask slots per block (k); the default block size at decoding time")
        parser.add_argument("--init-from", type=str, metavar="PATH",
                            help="AR fairseq checkpoint whose weights initialise every tensor of equal name "
                                 "and shape (encoder, embeddings, the first decoder layers)")

    @classmethod
    def build_model(cls, args, task):
        k = getattr(args, "draft_block_size", None)
        if k is None or k < 1:
            raise ValueError(f"--draft-block-size must be >= 1, got {k}")
        if getattr(args, "target_dict_sha", None) is None:  # recorded at training time, checked when decoding
            args.target_dict_sha = dictionary_sha(task.target_dictionary)
        model = super().build_model(args, task)
        model.draft_block_size = k
        path = getattr(args, "init_from", None)
        if path:
            init_from_checkpoint(model, path)
            args.init_from = None  # saved checkpoints must not reload the AR weights (or need its path)
        return model

    def draft_logits(self, encoder_out, tokens: Tensor, positions: Tensor, block_pad: Tensor, k: int,
                     state=None, max_position: Optional[int] = None, block: Optional[BlockDecoder] = None) -> Tensor:
        """Logits [N, k, V] at the mask slots (the last k) of the block `tokens` [N, m]; `block`: this
        decoder's BlockDecoder, kept by a caller that drafts many times."""
        block = block or BlockDecoder(self.decoder)
        return block(tokens, positions, encoder_out, state, block_pad, tail=k, logits_for_tail=True,
                     max_position=max_position)


def dictionary_sha(d) -> str:
    """Checksum of a fairseq Dictionary's symbols in order: equal ids mean equal tokens."""
    return hashlib.sha256("\n".join(d.symbols).encode("utf-8")).hexdigest()[:16]


def load_drafter(path: str, task, like: Optional[torch.nn.Module] = None) -> BlockDrafterModel:
    """Load a block_drafter checkpoint for decoding with `task`'s dictionaries (drafter_state), on
    the device and in the dtype of `like` (the verifier)."""
    state = drafter_state(path, task)
    margs = state["cfg"]["model"]
    margs.init_from = None
    model = task.build_model(margs)
    model.load_state_dict(state["model"], strict=True)
    if like is not None:
        p = next(like.parameters())
        model.to(device=p.device, dtype=p.dtype)
    return model.eval()


def drafter_state(path: str, task) -> dict:
    """The checkpoint state at `path`, checked to be a block_drafter trained with `task`'s target
    dictionary: one trained with another would draft ids that mean other tokens, so that is an
    error, not a silent slowdown."""
    from fairseq import checkpoint_utils
    from fairseq.models import ARCH_MODEL_REGISTRY

    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        margs = state["cfg"]["model"]
    except Exception as e:  # a torch file that is no fairseq checkpoint, or one torch cannot read
        raise UsageError(f"--drafter {path} is not a readable fairseq checkpoint ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from e
    arch = getattr(margs, "arch", None) or getattr(margs, "_name", None)
    if ARCH_MODEL_REGISTRY.get(arch) is not BlockDrafterModel:
        raise UsageError(f"--drafter {path} is a {arch!r} model, not a block_drafter "
                         "(train one with scripts/train_drafter.sh)")
    d = task.target_dictionary
    rows = state["model"]["decoder.embed_tokens.weight"].shape[0]
    sha = getattr(margs, "target_dict_sha", None)
    if rows != len(d) or (sha is not None and sha != dictionary_sha(d)):
        raise UsageError(f"--drafter {path} was trained with a different target dictionary ({rows} types) than "
                         f"the verifier's ({len(d)} types{', same size, other tokens' if rows == len(d) else ''}); "
                         "drafter and verifier must share the dictionary")
    return state


def init_from_checkpoint(model: torch.nn.Module, path: str) -> int:
    """Copy every tensor of the checkpoint whose name and shape match; returns how many were copied."""
    from fairseq import checkpoint_utils

    src = checkpoint_utils.load_checkpoint_to_cpu(path)["model"]
    own = model.state_dict()
    take = {k: v for k, v in src.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(take, strict=False)
    logger.info("block_drafter: initialised %d of %d tensors from %s", len(take), len(own), path)
    return len(take)


def training_blocks(target: Tensor, pad: int, bos: int, mask: int, k: int, prefix_len: Optional[Tensor] = None):
    """Drafter inputs from gold targets [B, T] (y1..yn EOS, right-padded), at a prefix length t in
    [0, n-1] per row (random unless `prefix_len` is given): tokens [B, P + k] = [BOS y1..yt, pad..,
    MASK x k], positions and block_pad [B, P + k], and labels [B, k] = y_{t+1}..y_{t+k} (pad past
    the row's end)."""
    b, t_max = target.shape
    dev = target.device
    n = target.ne(pad).sum(1)
    if prefix_len is None:
        u = torch.rand(b).to(dev)
        prefix_len = (u * n.to(u.dtype)).long().clamp(max=n - 1)
    p = int(prefix_len.max()) + 1
    cols = torch.arange(p, device=dev)
    shifted = torch.cat([target.new_full((b, 1), bos), target], 1)[:, :p]  # p <= T: t <= n - 1
    head_pad = cols.unsqueeze(0) > prefix_len.unsqueeze(1)
    head = shifted.masked_fill(head_pad, pad)
    tokens = torch.cat([head, target.new_full((b, k), mask)], 1)
    q = torch.arange(k, device=dev)
    positions = torch.cat([cols.expand(b, p), prefix_len.unsqueeze(1) + 1 + q], 1)
    block_pad = torch.cat([head_pad, torch.zeros(b, k, dtype=torch.bool, device=dev)], 1)
    idx = prefix_len.unsqueeze(1) + q
    labels = target.gather(1, idx.clamp(max=t_max - 1)).masked_fill(idx >= t_max, pad)
    return tokens, positions, block_pad, labels


@register_model_architecture("block_drafter", "block_drafter")
def block_drafter_architecture(args):
    args.draft_block_size = getattr(args, "draft_block_size", 8)
    base_architecture(args)


@register_model_architecture("block_drafter", "block_drafter_small")
def block_drafter_small(args):
    """The size of shared/models/deen-tiny (3+3 layers, d=256), for drafters initialised from it."""
    small = dict(encoder_embed_dim=256, decoder_embed_dim=256, encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_layers=3, decoder_layers=2)
    for name, default in small.items():
        setattr(args, name, getattr(args, name, default))
    block_drafter_architecture(args)
