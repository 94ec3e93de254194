"""Invariant 3: IAD == greedy decoding (fairseq --beam 1), token for token, whatever the batch,
refill, block size and drafts; float64 where batch composition could move a float32 rounding."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator
from helpers import (
    BIN,
    N_TEST,
    REPO,
    assert_same_hypos,
    block_of,
    fairseq_generate,
    gec_sample,
    gec_tiny,
    make_dict,
    make_sample,
    random_sentences,
    random_transformer,
    run_cli,
)

from fairseq_streambeam import Budget
from fairseq_streambeam.drafters.input_copy import DELETION_WINDOW, CopyState, InputCopyDrafter
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.runtime.kv_cache import KVCache

D = make_dict(30)


def iad(models, sample, **kw):
    gen = AggressiveGenerator(models, D, **kw)
    return gen.generate(models, sample), gen


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n,block", [(100, 0), (3, 0), (2, 2), (1, 1)])
def test_iad_equals_greedy_on_random_models(seed, n, block):
    m = random_transformer(D, 50 + seed, eos_bias=2.0).double()
    s = make_sample(D, random_sentences(D, 10, 60 + seed, max_len=14))
    kw = dict(max_len_b=12, min_len=2, unk_penalty=0.3, len_penalty=0.8)
    ref = fairseq_generate([m], D, s, beam_size=1, **kw)
    got, gen = iad([m], s, budget=Budget(n), drafter=InputCopyDrafter(2, block), **kw)
    assert_same_hypos(ref, got)
    assert gen.counters.sentences == 10


class OracleDrafter(InputCopyDrafter):
    """Drafts the true greedy continuation with every 5th token corrupted: long acceptances,
    bifurcations and rollbacks in every pass, whatever the random model does."""

    def __init__(self, truth):
        super().__init__(2, 0)
        self.truth = truth

    def start(self, src):
        return CopyState(src, 0)

    def draft(self, st, batched=False, cap=None):
        out_len = st.pos
        t = self.truth[tuple(st.src)][out_len:]
        return [w if (out_len + i) % 5 != 4 else 4 for i, w in enumerate(t)][:cap]

    def update(self, st, accepted):
        st.pos += len(accepted)


def test_long_accepts_and_rollbacks_with_compaction(monkeypatch):
    monkeypatch.setattr(KVCache, "compact_slack", 0)  # compact as soon as any slot is masked
    m = random_transformer(D, 70, eos_bias=1.0).double()
    sents = random_sentences(D, 8, 71, max_len=14)
    s = make_sample(D, sents)
    ref = fairseq_generate([m], D, s, beam_size=1, max_len_b=25)
    src_rows = [s["net_input"]["src_tokens"][i] for i in range(len(sents))]
    truth = {tuple(r[r.ne(D.pad())].tolist()): h[0]["tokens"].tolist() for r, h in zip(src_rows, ref)}
    got, gen = iad([m], s, max_len_b=25, budget=Budget(3), drafter=OracleDrafter(truth))
    assert_same_hypos(ref, got)
    assert gen.counters.accepted_per_pass > 2  # the drafts were really accepted in blocks


def test_iad_ensemble_equals_greedy():
    models = [random_transformer(D, 80).double(), random_transformer(D, 81).double()]
    s = make_sample(D, random_sentences(D, 6, 82))
    assert_same_hypos(fairseq_generate(models, D, s, beam_size=1, max_len_b=10), iad(models, s, max_len_b=10)[0])


def test_gec_tiny_iad_equals_greedy_and_copies():
    models, task = gec_tiny()
    models = [m.double() for m in models]
    d, s = task.target_dictionary, gec_sample(task, 60)
    ref = fairseq_generate(models, d, s, beam_size=1)
    for n in (1, 6):
        gen = AggressiveGenerator(models, d, budget=Budget(n))
        assert_same_hypos(ref, gen.generate(models, s), msg=f"budget {n}")
        assert gen.counters.accepted_per_pass > 3  # GEC output copies the input: drafts are accepted


def test_gec_tiny_float32_iad_on_repacked_weights_agrees_with_fairseq_greedy():
    """float32, a call over enough sources that verification multiplies by repacked weights
    (oneDNN's layout where torch has it): products round otherwise than fairseq's, so require
    near-total agreement (the whole CoNLL-14 set is identical in docs/benchmarks.md)."""
    models, task = gec_tiny()
    d, s = task.target_dictionary, gec_sample(task, 40)
    ref = fairseq_generate(models, d, s, beam_size=1)
    gen = AggressiveGenerator(models, d)
    got = gen.generate(models, s)
    assert gen.blocks[0].repacked._copies and len(s["id"]) >= gen.blocks[0].repacked.MIN_SOURCES
    same = sum(a[0]["tokens"].tolist() == b[0]["tokens"].tolist() for a, b in zip(ref, got))
    assert same >= len(ref) - 1, f"float32 agreement {same}/{len(ref)}"


def test_drafter_realigns_on_a_unique_ngram():
    dr = InputCopyDrafter(ngram=2, block_size=3)
    st = dr.start([5, 6, 7, 8, 9, 5, 2])
    assert dr.draft(st) == [5, 6, 7]
    dr.update(st, [5, 11])  # bifurcation after 5: (5, 11) is not in the source
    assert st.pos is None and dr.draft(st) == []
    dr.update(st, [7])  # (11, 7) is not in the source either
    assert st.pos is None and dr.draft(st) == []
    dr.update(st, [8])  # (7, 8) occurs once: copy from 9 on
    assert dr.draft(st) == [9, 5, 2] and dr.draft(st, cap=2) == [9, 5]
    dr.update(st, [5])  # (8, 5) does not occur: lost again
    assert st.pos is None
    with pytest.raises(ValueError, match="iad-ngram"):
        InputCopyDrafter(ngram=0)
    with pytest.raises(ValueError, match="block-size"):
        InputCopyDrafter(block_size=-1)


def test_batched_rows_draft_from_a_guessed_edit():
    """After a bifurcation a batched row drafts from where a substitution (or deletion) would
    resume; a lone row does not draft a substitution's guess; a guess that fails at once is not
    repeated."""
    dr = InputCopyDrafter(ngram=2, block_size=3)
    st = dr.start([5, 6, 7, 8, 9, 10, 2])
    dr.draft(st, batched=True)
    dr.update(st, [5, 11])  # 11 replaced 6: resume at 7
    assert st.pos is None and dr.draft(st) == [] and dr.draft(st, batched=True) == [7, 8, 9]
    dr.update(st, [7, 8, 12])  # the guess held for 2 tokens, then 12 replaced 9
    assert dr.draft(st, batched=True) == [10, 2]
    dr.update(st, [13])  # failed at once: no new guess
    assert dr.draft(st, batched=True) == []
    st = dr.start([5, 6, 7, 8, 9, 10, 2])
    dr.draft(st, batched=True)
    dr.update(st, [5, 7])  # 6 deleted: resume after 7
    assert dr.draft(st, batched=True) == [8, 9, 10]


def test_rows_draft_from_a_guessed_deletion():
    """A model token that occurs just ahead in the source deleted the tokens before it: every row,
    a lone one too, drafts from after it; one further ahead than the window is no deletion's."""
    dr = InputCopyDrafter(ngram=2)
    src = [5, 6, 7, 8, 9, 10, 2]
    st = dr.start(src)
    dr.draft(st)
    dr.update(st, [5, 8])  # 6 and 7 deleted: resume after 8
    assert st.pos is None and dr.draft(st) == [9, 10, 2] and dr.draft(st, batched=True) == [9, 10, 2]
    dr.update(st, [9, 11])  # the guess held for a token, then 11 replaced 10: a lone row waits
    assert dr.draft(st) == [] and dr.draft(st, batched=True) == [2]
    edge = [5] + list(range(20, 20 + DELETION_WINDOW)) + [8, 9, 2]
    st = dr.start(edge)
    dr.draft(st)
    dr.update(st, [5, 8])  # 8 is the window's last token ahead of the edit: a deletion
    assert dr.draft(st) == [9, 2]
    st = dr.start([5] + list(range(20, 21 + DELETION_WINDOW)) + [8, 9, 2])
    dr.draft(st)
    dr.update(st, [5, 8])  # 8 lies past the window: a replacement's guess, which a lone row does not draft
    assert dr.draft(st) == [] and dr.draft(st, batched=True)[:2] == [21, 22]


def test_empty_source_and_refused_inputs():
    m = random_transformer(D, 90)
    s = make_sample(D, [[], [5, 6]])
    out, _ = iad([m], s, max_len_b=6)
    assert all(h[0]["tokens"][-1].item() == D.eos() for h in out)
    with pytest.raises(NotImplementedError, match="constraints"):
        AggressiveGenerator([m], D).generate([m], s, constraints=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        AggressiveGenerator([m], make_dict(31))


def test_fairseq_generate_iad(tiny_run):
    data, ckpt = tiny_run
    common = [str(BIN / "fairseq-generate"), str(data), "--user-dir", str(REPO / "fairseq_streambeam"), "--task",
              "streambeam_translation", "--path", str(ckpt), "--gen-subset", "test", "-s", "src", "-t", "tgt",
              "--cpu", "--batch-size", "5", "--beam", "1"]
    got = run_cli([*common, "--decoding", "iad", "--stream-window", "4"])
    ref = run_cli([*common, "--decoding", "fairseq"])
    assert got.returncode == 0 and ref.returncode == 0, got.stderr[-2000:] + ref.stderr[-2000:]
    hyp = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", got.stdout, re.M))
    assert sorted(map(int, hyp)) == list(range(N_TEST))
    want = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", ref.stdout, re.M))
    same = sum(hyp[k] == want[k] for k in want)
    assert same >= N_TEST - 2, f"float32 agreement with greedy {same}/{N_TEST}"  # float64 tests are exact
    assert "tokens accepted per row and pass" in got.stdout + got.stderr


def test_encoder_keys_of_departed_long_sources_are_trimmed(monkeypatch):
    """Streaming groups pad cached encoder keys to their longest source; when the rows holding
    the long sources leave, those columns are dropped (and the output is still greedy's)."""
    from fairseq_streambeam.runtime.kv_cache import KVCache

    widths = []
    trim = KVCache.trim_encoder

    def spy(cache):
        def width():
            return cache.decoders[0].layers[0].encoder_attn._get_input_buffer(cache.states[0])["prev_key"].size(2)
        before = width()
        trim(cache)
        widths.append((before, width()))

    monkeypatch.setattr(KVCache, "trim_encoder", spy)  # called by KVCache.select when rows leave
    m = random_transformer(D, 93, eos_bias=2.0).double()
    sents = [random_sentences(D, 1, 94 + i, min_len=n, max_len=n)[0] for i, n in enumerate([14, 2, 13, 3, 2, 12, 2, 3])]
    s = make_sample(D, sents)
    ref = fairseq_generate([m], D, s, beam_size=1, max_len_b=8)
    got, _ = iad([m], s, max_len_b=8, budget=Budget(3), refill_eps=0.5)
    assert_same_hypos(ref, got)
    assert any(after < before for before, after in widths), widths


def _nan_log_probs(model, column: int):
    """Make `model` return NaN log-probs at `column` wherever that token is likelier than token
    8: some rows of a pass with a NaN and some without, the case fairseq maps to -inf."""
    normalized = model.get_normalized_probs

    def patched(net_output, log_probs, sample=None):
        lp = normalized(net_output, log_probs, sample)
        return lp.masked_fill(F.pad(lp[..., column:column + 1] > lp[..., 8:9], (column, lp.size(-1) - column - 1)),
                              float("nan"))
    model.get_normalized_probs = patched  # fairseq's ensemble and the block verifier both call it
    return model


@pytest.mark.parametrize("column", [7, "unk"])
@pytest.mark.parametrize("n", [1, 4])
def test_nan_log_probs_are_handled_like_fairseq(column, n):
    """fairseq turns NaN log-probs into -inf before choosing; top-1 verification skips that pass
    and redoes a pass only when a NaN reaches a top-1: the output must not change either way."""
    m = _nan_log_probs(random_transformer(D, 80, eos_bias=1.0).double(), D.unk() if column == "unk" else column)
    s = make_sample(D, random_sentences(D, 8, 81, max_len=10))
    kw = dict(max_len_b=9, min_len=2, unk_penalty=0.5)
    ref = fairseq_generate([m], D, s, beam_size=1, **kw)
    gen = AggressiveGenerator([m], D, budget=Budget(n), **kw)
    redone = []
    fix_rows = gen.penalties.fix_rows
    gen.penalties.fix_rows = lambda *a: redone.append(1) or fix_rows(*a)
    assert_same_hypos(ref, gen.generate([m], s))
    assert redone  # some NaN reached a top-1: the full adjustments ran


@pytest.mark.parametrize("kw", [dict(max_len_b=3), dict(max_len_b=4, min_len=3)])
def test_forced_eos_at_the_length_limit(kw):
    """Top-1 verification reads forced EOS off the EOS column instead of masking every row at the
    limit."""
    m = random_transformer(D, 82, eos_bias=-4.0).double()  # rarely ends by itself
    s = make_sample(D, random_sentences(D, 6, 83, max_len=8))
    ref = fairseq_generate([m], D, s, beam_size=1, **kw)
    for n in (1, 6):
        assert_same_hypos(ref, iad([m], s, budget=Budget(n), **kw)[0], msg=f"{kw} n={n}")


def test_forced_eos_not_allowed_asks_for_the_full_path():
    """At a slot at the length limit where EOS is not allowed either (a source whose limit is
    below --min-len), top-1 verification returns NaN so the pass is redone with every adjustment."""
    gen = AggressiveGenerator([random_transformer(D, 84)], D)
    lp = torch.log_softmax(torch.randn(1, 3, 30), -1)
    lp[0, 1, D.eos()] = -math.inf
    forced = torch.tensor([[False, True, True]])
    v = gen._accept(lp.view(3, 30), block_of(torch.tensor([[5, 6, 7]])), forced.view(3).numpy())
    assert v.best[0].tolist()[1:] == [D.eos(), D.eos()]  # forced EOS wherever the limit is reached
    assert math.isnan(v.best_lp[0, 1]) and v.best_lp[0, 2] == lp[0, 2, D.eos()]
    assert v.best_lp[0, 0] == lp[0, 0].max()


@pytest.mark.parametrize("block", [0, 2])
def test_prefix_tokens_equal_greedy_with_the_prefix(block):
    """fairseq-generate's --prefix-size hands the generator the first target tokens, right-padded
    (pad: not forced) and possibly ending in EOS; IAD forces them as fairseq's greedy decoding
    does, also across refill and with the minimum length and suppressed tokens in play."""
    m = random_transformer(D, 95, eos_bias=1.0).double()
    sents = random_sentences(D, 9, 96, max_len=10)
    s = make_sample(D, sents)
    g = torch.Generator().manual_seed(97)
    prefix = torch.randint(D.nspecial, len(D), (9, 4), generator=g)
    prefix[1, 2:] = D.pad()  # a short target: the rest is free
    prefix[2, 1] = D.eos()  # a target of one token: the output ends with it
    prefix[2, 2:] = D.pad()
    prefix[3] = torch.tensor(sents[3][:4] + [D.eos()] * 4)[:4]  # the draft agrees with the prefix
    kw = dict(max_len_b=9, min_len=3)
    suppress = [D.index("w7")]
    ref = SequenceGenerator([m], D, beam_size=1, tokens_to_suppress=["w7"], **kw).generate(
        [m], s, prefix_tokens=prefix)
    for budget in (Budget(100), Budget(2)):
        got = AggressiveGenerator([m], D, budget=budget, drafter=InputCopyDrafter(block_size=block), **kw)
        got.penalties.suppress = torch.tensor(suppress)
        assert_same_hypos(ref, got.generate([m], s, prefix_tokens=prefix), msg=f"{budget}")
    assert ref[2][0]["tokens"].tolist() == prefix[2, :2].tolist()
