"""Host work per decoder step: each decoding on a random transformer so small that its step is all
host work (Python, dispatch, small copies), as deen-tiny's step is on an H100 (docs/benchmarks.md,
"Host work per step"). Every output runs to the length limit (--min-len at the limit), so every
decoding takes the same steps (`iad`, greedy's output drafted from the source, fewer: its passes).
Times the decodings interleaved in one process (minimum over rounds) and counts the torch
operators they dispatch (on a GPU, a kernel launch or a view each); both are a whole generate
call's, encoder included, divided by its decoder steps.

  python scripts/host_step.py [--sources 8] [--beam 5] [--layers 3] [--dim 16] [--rounds 7] [--device cuda]
                             [--compile | --graph-steps]

`--compile` gives the plugin's decodings --compile (on CUDA, their steps replayed as CUDA graphs);
the timed rounds follow one untimed run of each, which compiles and captures. `--graph-steps` runs
their steps on the static shapes that --compile replays on CUDA, eagerly on the CPU, and counts
only the operators dispatched around them: what the host launches per step besides a graph's replay.
Its times are those of the static steps run eagerly on the CPU, not of a replay: read its operator
counts only.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from fairseq.data import Dictionary, LanguagePairDataset
from fairseq.models.transformer import TransformerModel, tiny_architecture
from fairseq.sequence_generator import SequenceGenerator
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_streambeam import StreamBeamGenerator
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.runtime.graph_step import GraphStep

DECODINGS = ("fairseq", "beam", "var-batch", "var-stream", "continuous", "iad")


class OpCount(TorchDispatchMode):
    """Counts the torch operators dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def random_model(layers: int, dim: int, vocab: int, seed: int = 3):
    """A random-weight fairseq transformer with peaked output distributions."""
    d = Dictionary()
    for i in range(vocab):
        d.add_symbol(f"w{i}")
    torch.manual_seed(seed)
    args = argparse.Namespace(share_all_embeddings=False, share_decoder_input_output_embed=False,
                              max_source_positions=256, max_target_positions=256, dropout=0.0)
    tiny_architecture(args)
    args.encoder_layers = args.decoder_layers = layers
    args.encoder_embed_dim = args.decoder_embed_dim = dim
    args.encoder_ffn_embed_dim = args.decoder_ffn_embed_dim = 2 * dim
    args.encoder_attention_heads = args.decoder_attention_heads = 2
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    model = TransformerModel.build_model(args, task).eval()
    with torch.no_grad():
        model.decoder.output_projection.weight.mul_(2.0)
    return model, d


def sample_of(d: Dictionary, n: int, seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    toks = [torch.cat([torch.randint(d.nspecial, len(d), (int(torch.randint(8, 21, (1,), generator=g)),),
                                     generator=g), torch.tensor([d.eos()])]) for _ in range(n)]
    ds = LanguagePairDataset(toks, [t.numel() for t in toks], d)
    return ds.collater([ds[i] for i in range(n)])


LENGTH = 40  # every output's length: the limit, and the minimum


def generator(name: str, model, d: Dictionary, beam: int, compile: bool = False):
    if name == "fairseq":
        return SequenceGenerator([model], d, beam_size=beam, max_len_b=LENGTH, min_len=LENGTH)
    if name == "iad":
        return AggressiveGenerator([model], d, max_len_b=LENGTH, min_len=LENGTH, compile=compile)
    order = {"stream_order": "continuous"} if name == "continuous" else {}
    return StreamBeamGenerator([model], d, beam_size=beam, max_len_b=LENGTH, min_len=LENGTH, compile=compile,
                               decoding="var-stream" if name == "continuous" else name, **order)


def graph_steps(gen, inside: collections.Counter) -> None:
    """`gen`'s steps on static shapes, on the CPU; the operators dispatched inside them (what a
    CUDA graph replays) are added to `inside`."""
    for block in gen.blocks:
        block.graph = GraphStep(block.decoder, on_cpu=True)
        run = block.graph._static

        def static(*args, run=run):
            with OpCount() as c:
                out = run(*args)
            inside.update(c.n)
            return out

        block.graph._static = static


def steps_of(gen, model, sample) -> int:
    """Decoder steps of one generate call (fairseq's generator: its forward_decoder calls)."""
    if isinstance(gen, (StreamBeamGenerator, AggressiveGenerator)):
        before = gen.counters.decoder_steps
        gen.generate([model], sample)
        return gen.counters.decoder_steps - before
    calls = [0]
    forward = gen.model.forward_decoder

    def counted(*a, **kw):
        calls[0] += 1
        return forward(*a, **kw)

    gen.model.forward_decoder = counted
    try:
        gen.generate([model], sample)
    finally:
        gen.model.forward_decoder = forward
    return calls[0]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", type=int, default=8)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--vocab", type=int, default=60)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model and batch go")
    p.add_argument("--compile", action="store_true", help="the plugin's decodings with --compile")
    p.add_argument("--graph-steps", action="store_true",
                   help="CPU: steps on static shapes, operators inside them not counted (read the counts, "
                        "not the times: the steps run eagerly)")
    p.add_argument("--decodings", default=",".join(DECODINGS), help="comma-separated, from " + ", ".join(DECODINGS))
    return p


def main(argv=None) -> None:
    p = parser()
    a = p.parse_args(argv)
    names = a.decodings.split(",")
    if bad := [n for n in names if n not in DECODINGS]:
        p.error(f"--decodings: unknown {', '.join(bad)} (known: {', '.join(DECODINGS)})")
    torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if a.graph_steps and a.device == "cuda":
        p.error("--graph-steps: on CUDA, --compile replays the steps as graphs")
    model, d = random_model(a.layers, a.dim, a.vocab)
    model.to(a.device)
    sample = sample_of(d, a.sources)
    sample["net_input"] = {k: v.to(a.device) for k, v in sample["net_input"].items()}
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    gens = {n: generator(n, model, d, a.beam, a.compile) for n in names}
    inside: collections.Counter = collections.Counter()
    if a.graph_steps:
        for n, g in gens.items():
            if n != "fairseq":
                graph_steps(g, inside)
    best = dict.fromkeys(names, float("inf"))
    with torch.no_grad():
        steps = {n: steps_of(g, model, sample) for n, g in gens.items()}
        for _ in range(a.rounds):
            for n, g in gens.items():
                sync()
                t = time.perf_counter()
                g.generate([model], sample)
                sync()
                best[n] = min(best[n], time.perf_counter() - t)
        ops = {}
        for n, g in gens.items():
            inside.clear()
            with OpCount() as c:
                g.generate([model], sample)
            ops[n] = sum(c.n.values()) - sum(inside.values())
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"{torch.get_num_threads()} thread(s)"
    print(f"torch {torch.__version__}, {where}; random transformer {a.layers}+{a.layers} "
          f"layers, d {a.dim}, {a.vocab} symbols; {a.sources} sources, beam {a.beam}; minimum of {a.rounds} rounds"
          + ("; the plugin's decodings with --compile" if a.compile else "")
          + ("; steps on static shapes, operators inside them not counted" if a.graph_steps else ""))
    print(f"| decoding | steps | ms per step | x {names[0]} | operators per step |")
    print("|---|---:|---:|---:|---:|")
    first = best[names[0]] / steps[names[0]]
    for n in names:
        per = best[n] / steps[n]
        print(f"| `{n}` | {steps[n]} | {1000 * per:.3f} | {per / first:.3f} | {ops[n] / steps[n]:.0f} |")


if __name__ == "__main__":
    main()
