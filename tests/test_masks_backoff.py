"""Iglesias et al.'s Algorithm 1 notes: constraints as token masks before top-k, and the backoff
stack of EOS candidates that never survived the beam; scorers compose (LMBR + masks)."""

import json
import math
import random

import pytest
import torch
from helpers import assert_same_hypos, make_dict, make_sample, ours, random_sentences, random_transformer

from fairseq_streambeam import Budget
from fairseq_streambeam.scorers.build_posteriors import Evidence
from fairseq_streambeam.scorers.lmbr import LMBRScorer, Theta
from fairseq_streambeam.scorers.masks import TokenMaskScorer, load_masks

D = make_dict(30)
EOS, PAD = D.eos(), D.pad()


def test_mask_scorer_allow_ban_and_unconstrained():
    s = TokenMaskScorer({1: ("allow", [5, 6]), 2: ("ban", [7, 8])}, EOS, PAD)
    st = s.start([1, 2, 3], torch.device("cpu"))
    out = s.score(torch.zeros(3, len(D)), st)
    finite = [set(torch.nonzero(torch.isfinite(r)).view(-1).tolist()) for r in out]
    assert finite[0] == {5, 6, EOS}  # an allow-list always lets the sentence end
    assert finite[1] == set(range(len(D))) - {7, 8}
    assert finite[2] == set(range(len(D)))
    assert s.advance(st, torch.tensor([5, 6, 7])).tolist() == st.tolist()


def test_load_masks(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"id": 4, "allow": [5]}) + "\n" + json.dumps({"id": 9, "ban": [6, 7]}) + "\n")
    assert load_masks(str(p)) == {4: ("allow", [5]), 9: ("ban", [6, 7])}
    p.write_text(json.dumps({"id": 4, "allow": [5], "ban": [6]}) + "\n")
    with pytest.raises(ValueError, match='exactly one list "allow" or "ban"'):
        load_masks(str(p))


@pytest.mark.parametrize("lines,message", [
    (['{"id": 0, "ban": [5]}', '{"id": 0, "ban": [7]}'], "m.jsonl:2: sentence 0 already has a record (line 1)"),
    (["not json"], "m.jsonl:1: not a mask record (Expecting value"),
    (['{"id": "x", "ban": [5]}'], "m.jsonl:1: not a mask record (id 'x' is not a whole number)"),
    (['{"id": 0, "ban": [5.7]}'], "m.jsonl:1: not a mask record (token id 5.7 is not a whole number)"),
    (['{"id": 0, "ban": 5}'], 'm.jsonl:1: not a mask record (a mask record has an "id"'),
    (["5"], 'm.jsonl:1: not a mask record (a mask record has an "id"'),
    (["", "  "], "m.jsonl: no mask record (the file is empty)"),
])
def test_mask_files_that_would_let_a_banned_token_through_or_fail_late_are_refused(tmp_path, lines, message):
    """A second record for a sentence replaced the first (its banned token came out); a float id was
    cut to another token; other malformed lines were bare JSON or type errors naming no file."""
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        load_masks(str(p))
    assert str(e.value).startswith(str(p).replace("m.jsonl", "") + message), str(e.value)


MODEL = random_transformer(D, 97).double()
SENTS = random_sentences(D, 9, 98)
SAMPLE = make_sample(D, SENTS)


def _stack():
    rng = random.Random(7)
    posts, masks = {}, {}
    for i in range(len(SENTS)):
        ev = [(rng.uniform(-5, -1), [rng.randrange(4, 30) for _ in range(rng.randint(2, 6))] + [EOS]) for _ in range(4)]
        posts[i] = Evidence([{i: ev}]).posteriors()[i]
        masks[i] = ("allow", sorted({g[0] for g in posts[i] if len(g) == 1}))
    return [LMBRScorer(posts, Theta.linear_bleu(), 0.5, PAD), TokenMaskScorer(masks, EOS, PAD)], masks


@pytest.mark.parametrize("decoding", ["beam", "var-batch"])
def test_masked_outputs_use_only_allowed_tokens(decoding):
    scorers, masks = _stack()
    out, _ = ours([MODEL], D, SAMPLE, beam_size=4, max_len_b=10, decoding=decoding, scorers=scorers)
    for row, sid in enumerate(SAMPLE["id"].tolist()):
        for h in out[row]:
            assert set(h["tokens"].tolist()) <= set(masks[sid][1]) | {EOS}


def test_composed_scorers_stream_equals_batch():
    batch = ours([MODEL], D, SAMPLE, beam_size=4, max_len_b=10, decoding="var-batch", scorers=_stack()[0])[0]
    for n in (1, 4):
        got = ours([MODEL], D, SAMPLE, beam_size=4, max_len_b=10, decoding="var-stream", budget=Budget(n),
                   scorers=_stack()[0])[0]
        assert_same_hypos(batch, got, atol=1e-5)


class KillAt:
    """A hard constraint that becomes unsatisfiable: every token is -inf from step `at` on."""

    def __init__(self, at):
        self.at = at

    def reset(self):
        pass

    def start(self, ids, device):
        return torch.zeros(len(ids), dtype=torch.long, device=device)

    def score(self, lprobs, state):
        return lprobs.masked_fill((state >= self.at).unsqueeze(1), -math.inf)

    def advance(self, state, tokens):
        return state + 1


def test_backoff_stack_answers_sources_that_never_finished():
    m = random_transformer(D, 95, eos_bias=3.5).double()
    sents = random_sentences(D, 12, 96)
    s = make_sample(D, sents)
    out, gen = ours([m], D, s, beam_size=3, max_len_b=12, scorers=[KillAt(3)], len_penalty=0.7)
    assert gen.counters.backoff_hypotheses >= 1  # the case exists in this setup
    checked = 0
    for row, sid in enumerate(s["id"].tolist()):
        h = out[row][0]
        if not math.isfinite(h["score"].item()):
            continue
        toks = h["tokens"].tolist()
        assert toks[-1] == EOS and len(toks) <= 3
        with torch.no_grad():  # every hypothesis, backoff or not, scores as the model says
            src = torch.tensor([sents[sid] + [EOS]])
            o = m(src, torch.tensor([src.size(1)]), torch.tensor([[EOS] + toks[:-1]]))
            lp = m.get_normalized_probs(o, log_probs=True)[0]
        ref = torch.tensor([lp[j, w].item() for j, w in enumerate(toks)], dtype=torch.float64)
        assert torch.allclose(h["positional_scores"].double(), ref, atol=1e-4)
        assert h["score"].item() == pytest.approx(ref.sum().item() / len(toks) ** 0.7, abs=1e-4)
        checked += 1
    assert checked >= gen.counters.backoff_hypotheses


def _reference_backoff(m, sent, k, steps):
    """fairseq's beam rule recomputed from scratch (no cache) for `steps` steps: returns
    (finals, best lost EOS) where a lost EOS is ranked in the top 2k but neither final nor kept."""
    beams, finals, lost = [([], 0.0)], [], None
    src = torch.tensor([sent + [EOS]])
    for step in range(steps):
        cands = []
        for toks, cum in beams:
            with torch.no_grad():
                o = m(src, torch.tensor([src.size(1)]), torch.tensor([[EOS] + toks]))
                lp = m.get_normalized_probs(o, log_probs=True)[0, -1].float()
            lp[PAD] = -math.inf
            if step < 1:
                lp[EOS] = -math.inf
            cands += [(cum + lp[w].item(), toks + [w]) for w in range(len(D)) if math.isfinite(lp[w].item())]
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * k]
        for r, (sc, t) in enumerate(cands):
            if t[-1] == EOS:
                if r < k and len(finals) < k:
                    finals.append(t)
                elif lost is None or sc > lost[0]:
                    lost = (sc, t)
        beams = [(t, sc) for sc, t in cands if t[-1] != EOS][:k]
    return finals, lost


def test_backoff_is_the_best_lost_eos_of_a_slow_reference():
    m = random_transformer(D, 95, eos_bias=3.5).double()
    sents = random_sentences(D, 12, 96)
    s = make_sample(D, sents)
    out, gen = ours([m], D, s, beam_size=3, max_len_b=12, scorers=[KillAt(3)], normalize_scores=False)
    used = 0
    for row, sid in enumerate(s["id"].tolist()):
        finals, lost = _reference_backoff(m, sents[sid], 3, 3)
        if finals:
            assert sorted(h["tokens"].tolist() for h in out[row]) == sorted(finals)
        elif lost is not None:
            assert out[row][0]["tokens"].tolist() == lost[1]
            assert out[row][0]["score"].item() == pytest.approx(lost[0], abs=1e-4)
            used += 1
        else:
            assert out[row][0]["score"].item() == -math.inf
    assert used == gen.counters.backoff_hypotheses >= 1


@pytest.mark.parametrize("option", [{"token_masks": "masks.jsonl"}, {"lmbr_posteriors": "posteriors.jsonl"}])
def test_scorer_files_without_scorer_objects_are_refused(option):
    """A generator built directly does not read scorer files (the task does): naming one without
    `scorers=` is refused, not decoded without the scorer."""
    from fairseq_streambeam import StreamBeamGenerator
    from fairseq_streambeam.spec import UsageError

    with pytest.raises(UsageError, match="need scorers="):
        StreamBeamGenerator([MODEL], D, beam_size=4, decoding="var-batch", **option)
