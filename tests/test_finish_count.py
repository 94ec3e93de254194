"""--finish-count (z): the sticky rule ends a source once z hypotheses are final.

The generator's finished lists equal a slow plain-Python implementation of the rule that decodes
one source at a time (float64 random models: token ids and scores); --nbest above z, or z with the
fairseq rule, is refused in one line; the option reaches the generator from fairseq-generate, the
hub and the bench (decode_corpus: tests/test_decode_corpus.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import List

import pytest
import torch
from helpers import BIN, REPO, make_dict, make_sample, ours, random_sentences, random_transformer
from helpers import run_cli as _run

D = make_dict(30)
MODELS = [random_transformer(D, 41).double(), random_transformer(D, 42, eos_bias=3.0).double()]
SENTS = random_sentences(D, 10, 43, min_len=1, max_len=12)
SAMPLE = make_sample(D, SENTS)
MAX_LEN = 9  # --max-len-b: forced EOS at step 9, so at most 10 tokens with EOS


# ---- a plain-Python reference of the sticky rule, one source at a time --------------------------


@dataclass
class Cand:
    tokens: List[int]  # after BOS; a finished candidate ends with EOS
    cum: List[float] = field(default_factory=list)  # cumulative log-prob after each token
    live: bool = True  # False: ended, carried on the beam with its score frozen

    @property
    def score(self) -> float:
        return self.cum[-1] if self.cum else 0.0


def next_lprobs(models, enc_outs, prefix: List[int]) -> torch.Tensor:
    """Log-probs of the next token after `prefix` (BOS first), the whole prefix re-run without an
    incremental state; an ensemble averages probabilities, as fairseq's EnsembleModel."""
    outs = []
    for m, enc in zip(models, enc_outs):
        logits, extra = m.decoder(torch.tensor([prefix]), encoder_out=enc)
        outs.append(m.get_normalized_probs((logits[:, -1:, :], extra), log_probs=True)[0, -1])
    if len(outs) == 1:
        return outs[0]
    return torch.logsumexp(torch.stack(outs), 0) - math.log(len(outs))


@torch.no_grad()
def reference_sticky(models, src: List[int], k: int, z: int, delta: float, max_cands: int,
                     max_len: int, len_penalty: float) -> List[dict]:
    """Each step: expand every live candidate (at most M children each, all if M = 0), rank them
    with the carried finished ones, look at the best k - (final so far); the leading run of ended
    candidates becomes final, up to z in all; keep the others within delta of the best candidate or
    final hypothesis; stop at z final, at no candidate left, or after the forced EOS at max_len."""
    eos, pad = D.eos(), D.pad()
    src_t = torch.tensor([src + [eos]])
    enc_outs = [m.encoder(src_t, src_lengths=torch.tensor([src_t.size(1)])) for m in models]
    beam = [Cand(tokens=[])]
    final: List[Cand] = []
    best_final = -math.inf
    for step in range(max_len + 1):
        cands = []  # (score, candidate after this step)
        for b in beam:
            if not b.live:
                cands.append((b.score, b))
                continue
            lp = next_lprobs(models, enc_outs, [eos] + b.tokens).clone()
            lp[pad] = -math.inf
            if step >= max_len:  # forced EOS, scored by the model
                lp[torch.arange(len(lp)) != eos] = -math.inf
            if step < 1:  # --min-len 1
                lp[eos] = -math.inf
            children = sorted(((b.score + float(lp[t]), t) for t in range(len(lp)) if lp[t] > -math.inf),
                              reverse=True)
            if max_cands:
                children = children[:max_cands]
            for s, t in children:
                cands.append((s, Cand(b.tokens + [t], b.cum + [s], live=t != eos)))
        cands.sort(key=lambda c: c[0], reverse=True)
        within = cands[: k - len(final)]
        n_lead = 0
        while n_lead < len(within) and not within[n_lead][1].live and len(final) + n_lead < z:
            n_lead += 1
        final += [c for _, c in within[:n_lead]]
        if n_lead:
            best_final = max(best_final, within[0][0])
        ref = max(within[0][0], best_final) if within else best_final
        keep = [c for s, c in within[n_lead:] if s > ref - delta]
        if len(final) >= z or not keep or step >= max_len:
            break
        beam = keep
    out = []
    for c in final:
        n = len(c.tokens)
        out.append({"tokens": c.tokens, "score": c.score / n ** len_penalty,
                    "positional": [c.cum[0]] + [b - a for a, b in zip(c.cum, c.cum[1:])]})
    return sorted(out, key=lambda h: h["score"], reverse=True)


CASES = [  # k, z, delta, M, decoding
    (6, 6, 1.2, 3, "var-batch"),
    (6, 1, 1.2, 3, "var-batch"),
    (6, 3, 1.2, 3, "var-stream"),
    (4, 4, 0.6, 0, "var-batch"),
    (5, 5, 2.5, 5, "var-stream"),
    (3, 2, math.inf, 2, "var-batch"),
    (1, 1, 1.5, 5, "var-batch"),
    (5, 5, None, None, "beam"),  # fixed beam with finalize="sticky": no delta, no M
]


@pytest.mark.parametrize("k,z,delta,m,decoding", CASES)
def test_finished_lists_equal_the_plain_reference(k, z, delta, m, decoding):
    kw = dict(beam_size=k, max_len_b=MAX_LEN, len_penalty=0.8, finish_count=z, finalize="sticky")
    if decoding.startswith("var-"):
        kw.update(prune_abs_threshold=delta, prune_max_cands=m)
    got, gen = ours(MODELS, D, SAMPLE, decoding=decoding, **kw)
    assert gen.finalizer.target == z
    n_hypos = []
    for row, sid in enumerate(SAMPLE["id"].tolist()):
        ref = reference_sticky(MODELS, SENTS[sid], k, z, math.inf if delta is None else delta, m or 0,
                               MAX_LEN, 0.8)
        hyp = got[row]
        assert [h["tokens"].tolist() for h in hyp] == [r["tokens"] for r in ref], f"source {sid}"
        for h, r in zip(hyp, ref):
            # float64 models; the generator keeps cumulative scores in float32
            assert abs(float(h["score"]) - r["score"]) < 1e-5, f"source {sid}"
            assert torch.allclose(h["positional_scores"].double(), torch.tensor(r["positional"], dtype=torch.float64),
                                  atol=1e-5)
        scores = [float(h["score"]) for h in hyp]
        assert scores == sorted(scores, reverse=True)  # best first: --nbest n prints the best n
        n_hypos.append(len(hyp))
    assert max(n_hypos) <= z
    if z > 1:  # the count matters: some source finished more than one hypothesis
        assert max(n_hypos) > 1


def test_finish_count_changes_the_output():
    """z = 1 stops a source at its first final hypothesis; z = k may find a better one."""
    kw = dict(beam_size=6, max_len_b=MAX_LEN, len_penalty=1.0, prune_abs_threshold=2.0, prune_max_cands=5)
    one = ours(MODELS, D, SAMPLE, decoding="var-batch", finish_count=1, **kw)[0]
    k = ours(MODELS, D, SAMPLE, decoding="var-batch", **kw)[0]
    assert all(len(h) == 1 for h in one)
    assert any(a[0]["tokens"].tolist() != b[0]["tokens"].tolist() for a, b in zip(one, k))
    assert all(float(b[0]["score"]) >= float(a[0]["score"]) - 1e-12 for a, b in zip(one, k))


def test_generator_refuses_contradictions():
    with pytest.raises(ValueError, match="--finish-count applies to the sticky rule"):
        ours(MODELS, D, SAMPLE, decoding="beam", beam_size=4, finish_count=2)
    with pytest.raises(ValueError, match="--nbest 3 asks for more hypotheses than the 2"):
        ours(MODELS, D, SAMPLE, decoding="var-batch", beam_size=4, finish_count=2, nbest=3)
    with pytest.raises(ValueError, match="between 1 and the beam size"):
        ours(MODELS, D, SAMPLE, decoding="var-stream", beam_size=4, finish_count=5)


# ---- front ends: fairseq-generate, the hub, the bench -------------------------------------------


def _generate(tiny_run, *extra):
    data, ckpt = tiny_run
    return _run([str(BIN / "fairseq-generate"), str(data), "--user-dir", str(REPO / "fairseq_streambeam"),
                 "--task", "streambeam_translation", "--path", str(ckpt), "--gen-subset", "test",
                 "--source-lang", "src", "--target-lang", "tgt", "--cpu", "--batch-size", "8", *extra])


def _one_line_error(r, text: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and text in errors[0], r.stderr[-2000:]


def test_cli_nbest_prints_the_best_of_z(tiny_run):
    r = _generate(tiny_run, "--beam", "4", "--decoding", "var-batch", "--finish-count", "3", "--nbest", "2",
                  "--prune-abs-threshold", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    per_id: dict = {}
    for i, s in re.findall(r"^H-(\d+)\t(\S+)\t", r.stdout, re.M):
        per_id.setdefault(int(i), []).append(float(s))
    assert per_id and max(len(v) for v in per_id.values()) == 2
    assert all(v == sorted(v, reverse=True) for v in per_id.values())


def test_cli_contradictions_are_one_line_errors(tiny_run):
    r = _generate(tiny_run, "--beam", "4", "--decoding", "var-stream", "--nbest", "5")
    _one_line_error(r, "--nbest 5 asks for more hypotheses than the 4 that end a source")
    r = _generate(tiny_run, "--beam", "4", "--decoding", "var-batch", "--finish-count", "2", "--nbest", "3")
    _one_line_error(r, "--nbest 3 asks for more hypotheses than the 2")
    r = _generate(tiny_run, "--beam", "4", "--decoding", "beam", "--finish-count", "2")
    _one_line_error(r, "--finish-count applies to the sticky rule")
    assert "loading model" not in r.stderr  # refused before fairseq loads the checkpoint
    r = _generate(tiny_run, "--beam", "4", "--decoding", "var-batch", "--finish-count", "0")
    _one_line_error(r, "--finish-count must be >= 1")
    r = _generate(tiny_run, "--beam", "4", "--decoding", "var-batch", "--finish-count", "5")
    _one_line_error(r, "--finish-count must be between 1 and the beam size (4)")


def test_hub_accepts_finish_count(tiny_run):
    from fairseq.models.transformer import TransformerModel

    from fairseq_streambeam import attach_to_hub

    data, ckpt = tiny_run
    hub = TransformerModel.from_pretrained(str(ckpt.parent), ckpt.name, data_name_or_path=str(data),
                                           source_lang="src", target_lang="tgt")
    attach_to_hub(hub, decoding="var-batch", finish_count=2)
    gen = hub.task.build_generator(hub.models, hub.cfg.generation)
    assert gen.finalizer.target == 2
    assert len(hub.translate(["w1 w2 w3", "w4"], beam=4)) == 2
    with pytest.raises(ValueError, match="--finish-count applies to the sticky rule"):
        attach_to_hub(hub, decoding="beam", finish_count=2)


def test_bench_finish_count_setting_and_variant(tiny_run, tmp_path):
    """The run-wide finish count goes to the sticky methods only (fairseq-rule methods finish k); a
    variant's own value wins; the default is k."""
    from fairseq_streambeam.bench.__main__ import main as bench_main

    data, ckpt = tiny_run
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"beam": 4, "batch_size": 8, "finish_count": 2, "variants": [
        "beam", "var-batch", {"name": "var-batch[z=1]", "decoding": "var-batch", "finish_count": 1},
        {"name": "var-batch[z=4]", "decoding": "var-batch", "finish_count": 4}]}))
    seen = []
    from fairseq_streambeam.task import StreamBeamTranslationTask

    build = StreamBeamTranslationTask.generator_for

    def spy(self, models, spec, *a, **kw):
        gen = build(self, models, spec, *a, **kw)
        seen.append((spec.decoding, gen.finalizer.target))
        return gen

    StreamBeamTranslationTask.generator_for = spy
    try:
        rows = bench_main(["--data", str(data), "--path", str(ckpt), "-s", "src", "-t", "tgt", "--post-process",
                           "none", "--out", str(tmp_path / "out"), "--quiet", "--limit", "12", "--no-plots",
                           "--config", str(cfg), "--baseline", "beam"])
    finally:
        StreamBeamTranslationTask.generator_for = build
    assert [r["method"] for r in rows] == ["beam", "var-batch", "var-batch[z=1]", "var-batch[z=4]"]
    # each method's generator is built once, for its untimed first batch and every repeat
    assert seen == [("beam", 4), ("var-batch", 2), ("var-batch", 1), ("var-batch", 4)]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["settings"]["finish_count"] == 2
