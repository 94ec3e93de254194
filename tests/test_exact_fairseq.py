"""Invariant 1: --decoding beam (and fixed-stream, fairseq finalization) == fairseq's SequenceGenerator."""

import sys

import pytest
import torch
from helpers import (
    REPO,
    assert_same_hypos,
    fairseq_generate,
    load_checkpoints,
    make_dict,
    make_sample,
    ours,
    random_sentences,
    random_transformer,
    run_cli,
    shared_path,
)

from fairseq_streambeam import Budget, StreamBeamGenerator


@pytest.fixture(scope="module")
def dict40():
    return make_dict(40)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beam", [1, 5, 12])
@pytest.mark.parametrize("lenpen", [1.0, 0.6])
def test_random_models_match_fairseq(dict40, seed, beam, lenpen):
    m = random_transformer(dict40, seed)
    s = make_sample(dict40, random_sentences(dict40, 9, seed + 10))
    kw = dict(beam_size=beam, len_penalty=lenpen, max_len_b=20)
    ref = fairseq_generate([m], dict40, s, **kw)
    got, _ = ours([m], dict40, s, **kw)
    assert_same_hypos(ref, got)
    stream, gen = ours([m], dict40, s, decoding="fixed-stream", budget=Budget(3), **kw)
    assert_same_hypos(ref, stream)
    assert gen.counters.sentences == 9


def test_random_ensemble_and_options_match_fairseq(dict40):
    models = [random_transformer(dict40, 3), random_transformer(dict40, 4)]
    s = make_sample(dict40, random_sentences(dict40, 8, 5))
    kw = dict(beam_size=6, max_len_b=15, min_len=3, unk_penalty=0.5, temperature=1.3)
    assert_same_hypos(fairseq_generate(models, dict40, s, **kw), ours(models, dict40, s, **kw)[0])
    kw = dict(beam_size=4, max_len_b=15, normalize_scores=False)
    assert_same_hypos(fairseq_generate(models, dict40, s, **kw), ours(models, dict40, s, **kw)[0])


def test_prefix_tokens_match_fairseq(dict40):
    m = random_transformer(dict40, 6)
    s = make_sample(dict40, random_sentences(dict40, 6, 7))
    prefix = torch.randint(dict40.nspecial, len(dict40), (6, 3))
    ref = SequenceGeneratorCall(m, dict40, s, prefix)
    from fairseq_streambeam import StreamBeamGenerator

    gen = StreamBeamGenerator([m], dict40, beam_size=4, max_len_b=12)
    got = gen.generate([m], s, prefix_tokens=prefix)
    assert_same_hypos(ref, got)
    for i, h in enumerate(got):
        assert h[0]["tokens"][:3].tolist() == prefix[i].tolist()


def SequenceGeneratorCall(m, d, s, prefix):
    from fairseq.sequence_generator import SequenceGenerator

    return SequenceGenerator([m], d, beam_size=4, max_len_b=12).generate([m], s, prefix_tokens=prefix)


def test_generic_encoder_out_path_matches(dict40):
    """The path for decoders that read encoder_out every step (kept and reordered per row)."""
    m = random_transformer(dict40, 8)
    s = make_sample(dict40, random_sentences(dict40, 7, 9))
    ref = fairseq_generate([m], dict40, s, beam_size=5, max_len_b=15)
    for kw in (dict(), dict(decoding="fixed-stream", budget=Budget(2))):
        gen = StreamBeamGenerator([m], dict40, beam_size=5, max_len_b=15, **kw)
        gen.keep_encoder_out, gen.mergeable = True, False  # as for decoders other than fairseq's transformer
        assert_same_hypos(ref, gen.generate([m], s))


def test_fairseq_generator_first_does_not_break_ours(dict40):
    """A model used by fairseq's generator (beamable attention may be set) still decodes right."""
    m = random_transformer(dict40, 11)
    s = make_sample(dict40, random_sentences(dict40, 5, 12))
    ref = fairseq_generate([m], dict40, s, beam_size=5, max_len_b=10)
    assert_same_hypos(ref, ours([m], dict40, s, beam_size=5, max_len_b=10)[0])


# ---- real checkpoints (../shared) --------------------------------------------------------------


def _deen_sample(task, n, stride):
    ds = task.dataset("test")
    sents = [ds.src[i][:-1].tolist() for i in range(0, stride * n, stride)]
    return make_sample(task.target_dictionary, sents)


@pytest.fixture(scope="module")
def deen():
    root = shared_path("models", "deen-tiny")
    models, task = load_checkpoints(root / "checkpoint_best.pt", data=root / "data-bin")
    task.load_dataset("test")
    return root, models, task


@pytest.mark.parametrize("beam,lenpen,n", [(1, 1.0, 24), (5, 1.0, 24), (5, 0.6, 16), (50, 1.0, 6)])
def test_deen_tiny_matches_fairseq(deen, beam, lenpen, n):
    _, models, task = deen
    d = task.target_dictionary
    s = _deen_sample(task, n, 3004 // n)
    kw = dict(beam_size=beam, len_penalty=lenpen)
    ref = fairseq_generate(models, d, s, **kw)
    got, gen = ours(models, d, s, **kw)
    assert_same_hypos(ref, got, msg=f"beam {beam}")
    # calls over 16 sources or more multiply by repacked weights (products rounded otherwise)
    assert bool(gen.blocks[0].repacked._copies) == bool(gen.encoders.lins[0]._copies) == (n >= 16)
    assert_same_hypos(ref, ours(models, d, s, decoding="fixed-stream", budget=Budget(4), **kw)[0])


def test_deen_tiny_ensemble_matches_fairseq(deen):
    root, _, task = deen
    models, _ = load_checkpoints(root / "checkpoint_best.pt", root / "checkpoint_ep5.pt", data=root / "data-bin")
    d = task.target_dictionary
    s = _deen_sample(task, 16, 180)  # 16 sources: repacked weights
    ref = fairseq_generate(models, d, s, beam_size=5)
    got, gen = ours(models, d, s, beam_size=5)
    assert_same_hypos(ref, got)
    assert all(b.repacked._copies for b in gen.blocks) and all(lin._copies for lin in gen.encoders.lins)


def test_agreement_script_reports_deen_tiny_equal_to_fairseq():
    """scripts/fairseq_agreement.py (the docs' exactness figures over whole test sets) decodes 16
    sentences, a call on repacked weights, and finds every hypothesis equal to fairseq's."""
    root = shared_path("models", "deen-tiny")
    r = run_cli([sys.executable, str(REPO / "scripts" / "fairseq_agreement.py"), "--data", str(root / "data-bin"),
                 "--path", str(root / "checkpoint_best.pt"), "-s", "de", "-t", "en", "--beam", "3", "--limit", "16"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "best hypothesis 16/16, every hypothesis in order 16/16" in r.stdout, r.stdout
    for bad, message in ((["--decoding", "var-stream"], "invalid choice: 'var-stream'"),
                         (["--decoding", "iad"], "--decoding iad outputs fairseq's --beam 1")):
        r = run_cli([sys.executable, str(REPO / "scripts" / "fairseq_agreement.py"), "--data", "x", "--path", "y",
                     "-s", "de", "-t", "en", *bad])  # decodings whose output is not fairseq's, or not at that k
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_enja_toy_matches_fairseq():
    root = shared_path("models", "enja-toy")
    models, task = load_checkpoints(root / "checkpoint_best.pt", data=root, source_lang="en", target_lang="ja")
    d_src, d = task.source_dictionary, task.target_dictionary
    lines = (root / "test.spm.en").read_text(encoding="utf-8").splitlines()[:20]
    sents = [d_src.encode_line(x, add_if_not_exist=False, append_eos=False).tolist() for x in lines]
    s = make_sample(d_src, sents)
    ref = fairseq_generate(models, d, s, beam_size=5, max_len_b=60)
    assert_same_hypos(ref, ours(models, d, s, beam_size=5, max_len_b=60)[0])


@pytest.mark.parametrize("decoding", ["beam", "fixed-stream"])
def test_nan_log_probs_match_fairseq(decoding):
    """NaN log-probs in some rows (fairseq turns them into -inf before ranking): the same output."""
    from test_aggressive import D as D_IAD
    from test_aggressive import _nan_log_probs

    m = _nan_log_probs(random_transformer(D_IAD, 84, eos_bias=1.0).double(), 7)
    s = make_sample(D_IAD, random_sentences(D_IAD, 8, 85, max_len=10))
    kw = dict(beam_size=4, max_len_b=9, min_len=2, unk_penalty=0.5)
    got, gen = ours([m], D_IAD, s, decoding=decoding, **kw)
    assert gen.lean_steps
    assert_same_hypos(fairseq_generate([m], D_IAD, s, **kw), got)


def test_nan_becomes_minus_inf_and_infinities_stay():
    """FairseqPenalties.fix_rows does what fairseq's lprobs[lprobs != lprobs] = -inf does."""
    from fairseq_streambeam.search.penalties import FairseqPenalties

    inf, nan = float("inf"), float("nan")
    lp = torch.tensor([[0.5, nan, inf, -inf, -1.0], [nan, nan, 0.0, 3e38, -3e38]], dtype=torch.float64)
    FairseqPenalties(pad=1, unk=3, eos=2).fix_rows(lp, None)
    assert lp.tolist() == [[0.5, -inf, inf, -inf, -1.0], [-inf, -inf, 0.0, 3e38, -3e38]]
