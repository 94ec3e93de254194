"""GAD / GAD++ (Ge et al. 2022): a block_drafter model drafts, the AR model verifies.

Exactness: with beta=1 the output equals fairseq's greedy SequenceGenerator (token ids and scores)
whatever the drafter drafts, so random drafters are as good a test as trained ones. The drafter's
incremental cache is checked against recomputing every draft from scratch.
"""

import math
import random
import time

import pytest
import torch
from helpers import (
    BIN,
    N_TEST,
    REPO,
    assert_same_hypos,
    block_of,
    fairseq_generate,
    load_checkpoints,
    make_dict,
    make_sample,
    random_drafter,
    random_sentences,
    random_transformer,
    run_cli,
    shared_path,
)

from fairseq_streambeam.drafters.block_model import ModelDrafter
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.models.block_drafter import training_blocks
from fairseq_streambeam.runtime.draft_budget import DraftSwitch
from fairseq_streambeam.runtime.kv_cache import KVCache
from fairseq_streambeam.runtime.scheduler import Budget
from fairseq_streambeam.spec import UsageError

D = make_dict(30)
PLUGIN = str(REPO / "fairseq_streambeam")  # --user-dir, whatever the working directory


def gad(models, sample, drafter, k=3, n=4, **kw):
    kw = {"decoding": "gad", "draft_min_reach": 0.0, "draft_switch": False, **kw}
    gen = AggressiveGenerator(models, D, drafter=ModelDrafter(drafter, D, k), budget=Budget(n), **kw)
    return gen.generate(models, sample), gen


@pytest.mark.parametrize("k,n", [(1, 1), (3, 1), (4, 3), (6, 12)])
def test_gad_beta1_equals_greedy(k, n):
    m = random_transformer(D, 10).double()
    dr = random_drafter(D, 11, k=4).double()
    s = make_sample(D, random_sentences(D, 12, 12))
    kw = dict(max_len_b=12, min_len=2, unk_penalty=0.3, len_penalty=0.8)
    ref = fairseq_generate([m], D, s, beam_size=1, **kw)
    got, gen = gad([m], s, dr, k=k, n=n, **kw)
    assert_same_hypos(ref, got)
    assert gen.counters.sentences == 12 and gen.counters.verified_rows > 0


def test_gad_ensemble_equals_greedy():
    models = [random_transformer(D, 20).double(), random_transformer(D, 21).double()]
    s = make_sample(D, random_sentences(D, 7, 22))
    ref = fairseq_generate(models, D, s, beam_size=1, max_len_b=10)
    assert_same_hypos(ref, gad(models, s, random_drafter(D, 23).double(), n=3, max_len_b=10)[0])


class Scribbling(ModelDrafter):
    """Writes over every list the generator hands it once it has read them (the accepted tokens,
    the caps): the generator's own state must not depend on them."""

    def propose(self, g, caps):
        out = super().propose(g, caps)
        caps[:] = [0] * len(caps)
        return out

    def advance(self, g, accepted):
        super().advance(g, accepted)
        for acc in accepted:
            acc[:] = [7, 7, 7]


def test_drafters_keep_no_reference_to_the_generators_lists():
    """Drafters get their tokens through `advance` and keep their own copies (they used to share
    the generator's output lists)."""
    m = random_transformer(D, 40).double()
    s = make_sample(D, random_sentences(D, 8, 41))
    ref = fairseq_generate([m], D, s, beam_size=1, max_len_b=12)
    gen = AggressiveGenerator([m], D, drafter=Scribbling(random_drafter(D, 42).double(), D, 3), budget=Budget(3),
                              max_len_b=12)
    got = gen.generate([m], s)
    assert_same_hypos(ref, got)
    assert gen.counters.accepted_tokens == sum(len(h[0]["tokens"]) for h in got)


class Recording(ModelDrafter):
    """Keeps (source row, row output so far, draft) for every row of every pass."""

    def propose(self, g, caps):
        drafts, lens = super().propose(g, caps)
        self.seen += [(src, list(o), drafts[i].tolist()) for i, (src, o) in enumerate(zip(g.rows, g.outs))]
        return drafts, lens


@pytest.mark.parametrize("skips", [None, "drop", 0])
def test_drafter_cache_equals_recomputing_every_draft(skips, monkeypatch):
    monkeypatch.setattr(KVCache, "compact_slack", 0)
    """Incremental drafting (pending tokens, cut mask slots, merges, dropped rows, compaction) drafts
    exactly what one uncached pass over [BOS + output, MASK x k] drafts; also when passes go without
    drafts (`skips`: pending tokens pile up, groups are built late; at a merge a built group drops
    its cache for an unbuilt one, "drop", or an unbuilt group is built for a built one, 0)."""
    m = random_transformer(D, 30, eos_bias=1.0).double()
    dr = random_drafter(D, 31, k=3, layers=2).double()
    s = make_sample(D, random_sentences(D, 9, 32))
    rec = Recording(dr, D, 3)
    rec.seen = []
    gen = AggressiveGenerator([m], D, drafter=rec, budget=Budget(3), max_len_b=20, decoding="gad",
                              draft_switch=skips is not None,
                              refill_eps=0.9)
    events = []
    if skips is not None:
        coin = random.Random(0)  # these patterns were seen to give the event
        pattern = iter([False, False, True] * 100)
        gen.draft_switch.drafting = ((lambda rows: next(pattern)) if skips == "drop"
                                     else (lambda rows: coin.random() < 0.4))
        feed, drop = rec._feed, rec._drop
        rec._feed = lambda g, k: events.append(k) or feed(g, k)
        rec._drop = lambda g: events.append("drop") or drop(g)
    assert_same_hypos(fairseq_generate([m], D, s, beam_size=1, max_len_b=20), gen.generate([m], s))
    assert skips is None or skips in events
    src = s["net_input"]["src_tokens"]
    enc_all = dr.encoder(src, src_lengths=s["net_input"]["src_lengths"])
    rec.seen = [x for x in rec.seen if x[2]]  # passes that drafted
    for i, out, draft in rec.seen:
        enc = dr.encoder.reorder_encoder_out(enc_all, torch.tensor([i]))
        target = torch.tensor([out + [D.eos()]])  # only the prefix matters
        k = len(draft)  # 3, or fewer where the length limit cut every row's draft
        toks, pos, pad, _ = training_blocks(target, D.pad(), D.eos(), D.unk(), k, prefix_len=torch.tensor([len(out)]))
        full = dr.draft_logits(enc, toks, pos, pad, k).argmax(-1)[0].tolist()
        assert draft == full, (i, out, draft, full)
    assert len(rec.seen) > (5 if skips is not None else 30)
    assert len({i for i, _, _ in rec.seen}) >= (3 if skips is not None else 9)


def test_gad_plus_plus_acceptance_rule():
    m = random_transformer(D, 40)
    gen = AggressiveGenerator([m], D, drafter=ModelDrafter(random_drafter(D, 41), D), decoding="gad",
                              gad_beta=2, gad_tau=1.0)
    lp = torch.full((1, 4, 30), -10.0)
    # slot 0: draft 5 is 2nd best, 0.5 below top-1 -> accepted; slot 1: draft 6 is top-1 -> accepted;
    # slot 2: draft 7 is 2nd best but 2.0 below top-1 -> rejected (tau); the verifier's top-1 follows
    lp[0, 0, 9], lp[0, 0, 5] = -0.5, -1.0
    lp[0, 1, 6] = -0.1
    lp[0, 2, 8], lp[0, 2, 7] = -0.2, -2.2
    block = torch.tensor([[2, 5, 6, 7]])
    lp = lp.view(4, 30)  # [N*m, V]
    v = gen._accept(lp, block_of(block))
    assert int(v.accepted[0]) == 2
    assert v.best[0].tolist()[:3] == [9, 6, 8]
    strict = AggressiveGenerator([m], D, drafter=ModelDrafter(random_drafter(D, 41), D))
    assert int(strict._accept(lp, block_of(block)).accepted[0]) == 0
    loose = AggressiveGenerator([m], D, drafter=ModelDrafter(random_drafter(D, 41), D), decoding="gad", gad_beta=2)
    assert int(loose._accept(lp, block_of(block)).accepted[0]) == 3
    padded = [[False, False, True, True]]  # a draft of one token: at most one accepted
    assert int(loose._accept(lp, block_of(block, padded)).accepted[0]) == 1


def test_gad_plus_plus_runs_and_accepts_more():
    m = random_transformer(D, 50).double()
    dr = random_drafter(D, 51, k=4).double()
    s = make_sample(D, random_sentences(D, 10, 52))
    strict = gad([m], s, dr, k=4, n=4, max_len_b=12)[1].counters.accepted_per_pass
    hyps, gen = gad([m], s, dr, k=4, n=4, max_len_b=12, gad_beta=30, gad_tau=math.inf)
    assert gen.counters.accepted_per_pass > strict  # accepts every draft token: k + 1 per pass when not ending
    for h in hyps:
        assert h[0]["tokens"][-1] == D.eos() and len(h[0]["tokens"]) <= 12 + 10 + 1


def test_gad_plus_plus_output_does_not_depend_on_earlier_calls():
    """GAD++ accepts drafts that are not greedy's, so which drafts it verifies shapes its output: it
    takes no draft cap learned from earlier passes (--draft-min-reach), and a generator that decoded
    other sources before gives what a fresh one gives."""
    m = random_transformer(D, 70).double()
    dr = random_drafter(D, 71, k=6).double()
    first, second = make_sample(D, random_sentences(D, 12, 72)), make_sample(D, random_sentences(D, 12, 73))
    kw = dict(k=6, n=3, max_len_b=15, gad_beta=3, gad_tau=2.0)
    fresh = gad([m], second, dr, **kw)[0]
    gen = gad([m], first, dr, **kw)[1]
    assert gen.draft_budget.min_reach == 0.0
    assert_same_hypos(fresh, gen.generate([m], second))
    with pytest.raises(UsageError, match="^--draft-min-reach caps drafts by what earlier passes accepted"):
        gad([m], second, dr, draft_min_reach=0.25, **kw)


def test_drafts_never_run_past_max_len():
    m = random_transformer(D, 60, eos_bias=-5.0).double()  # rarely ends by itself: the length limit ends it
    dr = random_drafter(D, 61, k=6).double()
    s = make_sample(D, random_sentences(D, 6, 62, max_len=4))
    for kw in (dict(max_len_b=3), dict(max_len_a=0, max_len_b=1)):
        ref = fairseq_generate([m], D, s, beam_size=1, **kw)
        assert_same_hypos(ref, gad([m], s, dr, k=6, n=2, **kw)[0], msg=str(kw))
        # GAD++ accepting everything still ends at the limit with EOS
        for h in gad([m], s, dr, k=6, n=2, gad_beta=30, **kw)[0]:
            assert len(h[0]["tokens"]) <= kw["max_len_b"] + 1 and h[0]["tokens"][-1] == D.eos()


def test_bad_drafter_and_options():
    m = random_transformer(D, 70)
    with pytest.raises(ValueError, match="block_drafter"):
        ModelDrafter(random_transformer(D, 71), D)
    for bad, flag in [(dict(block_size=-1), "block-size"), (dict(gad_beta=0), "gad-beta"),
                      (dict(gad_tau=-1.0), "gad-tau"),
                      (dict(gad_beta=2), "--gad-beta applies to --decoding gad, not --decoding iad")]:
        with pytest.raises(ValueError, match=flag):
            AggressiveGenerator([m], D, drafter=ModelDrafter(random_drafter(D, 72), D),
                                **{"decoding": "gad", **bad} if "applies" not in flag else bad)


def test_training_blocks_layout():
    pad, bos, mask = D.pad(), D.eos(), D.unk()
    target = torch.tensor([[7, 8, 9, 2], [5, 2, pad, pad]])
    toks, pos, bpad, labels = training_blocks(target, pad, bos, mask, 3, prefix_len=torch.tensor([2, 0]))
    assert toks.tolist() == [[bos, 7, 8, mask, mask, mask], [bos, pad, pad, mask, mask, mask]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 1, 2, 3]]
    assert bpad.tolist() == [[False] * 6, [False, True, True, False, False, False]]
    assert labels.tolist() == [[9, 2, pad], [5, 2, pad]]
    for _ in range(20):  # random prefix lengths stay inside each row
        toks, pos, bpad, labels = training_blocks(target, pad, bos, mask, 2)
        assert labels[:, 0].ne(pad).all()


def test_train_drafter_with_fairseq_train_and_decode_with_it(tiny_run, tiny_drafter):
    """fairseq-train --user-dir trains a drafter (initialised from the AR checkpoint, glancing),
    reports its accepted draft length on validation, and fairseq-generate --decoding gad with it
    prints exactly what --decoding greedy prints."""
    data, ckpt = tiny_run
    drafter, log = tiny_drafter
    assert "draft_accepted" in log
    state = torch.load(drafter, weights_only=False)
    assert state["cfg"]["model"].init_from is None  # decoding must not need the AR checkpoint's path

    def generate(*extra):
        r = run_cli([str(BIN / "fairseq-generate"), str(data), "--path", str(ckpt), "--user-dir", PLUGIN,
                     "--task", "streambeam_translation", "--gen-subset", "test", "--beam", "1", "--batch-size", "8",
                     "--cpu", *extra])
        assert r.returncode == 0, r.stderr[-3000:]
        hyps = {}
        for line in r.stdout.splitlines():
            if line.startswith("H-"):
                key, score, text = line.split("\t")
                hyps[key] = (text, float(score))
        return hyps

    def same(a, b):  # float32: block verification sums in another order than one-token steps
        assert a.keys() == b.keys()
        for key in a:
            assert a[key][0] == b[key][0], key
            assert abs(a[key][1] - b[key][1]) < 1e-4, key

    greedy = generate("--decoding", "greedy")
    assert len(greedy) == N_TEST
    same(generate("--decoding", "gad", "--drafter", str(drafter)), greedy)
    same(generate("--decoding", "gad", "--drafter", str(drafter), "--block-size", "1"), greedy)


def test_gad_cli_errors(tiny_run, tmp_path):
    data, ckpt = tiny_run
    base = [str(BIN / "fairseq-generate"), str(data), "--path", str(ckpt), "--user-dir", PLUGIN,
            "--task", "streambeam_translation", "--gen-subset", "test", "--beam", "1", "--cpu"]
    r = run_cli(base + ["--decoding", "gad"])
    assert r.returncode == 2 and "needs --drafter PATH" in r.stderr
    r = run_cli(base + ["--decoding", "gad", "--drafter", str(ckpt), "--draft-lookup", str(tmp_path / "t.txt")])
    assert r.returncode == 2 and "not both" in r.stderr
    r = run_cli(base + ["--decoding", "gad", "--draft-lookup", str(tmp_path / "missing.txt")])
    assert r.returncode == 2 and "no such file" in r.stderr
    r = run_cli(base + ["--decoding", "gad", "--drafter", str(ckpt)])  # an AR checkpoint is no drafter
    assert r.returncode == 2 and "not a block_drafter" in r.stderr
    for extra in (["--gad-beta", "2"], ["--gad-tau", "1"], ["--draft-lookup", str(tmp_path / "t.txt")]):
        r = run_cli(base + ["--decoding", "iad", *extra])
        assert r.returncode == 2 and "to --decoding gad, not --decoding iad" in r.stderr


def test_a_checkpoint_that_is_no_drafter_is_refused_when_the_task_is_built(tiny_run):
    """Before fairseq-generate loads the verifier (minutes for an ensemble), not after."""
    from fairseq_streambeam.options import StreamBeamConfig
    from fairseq_streambeam.spec import UsageError
    from fairseq_streambeam.task import StreamBeamTranslationTask

    _, ckpt = tiny_run
    with pytest.raises(UsageError, match="not a block_drafter"):
        StreamBeamTranslationTask(StreamBeamConfig(train_subset="train", decoding="gad", drafter=str(ckpt)), D, D)


def test_drafter_with_another_dictionary_is_refused(tmp_path):
    """Same size, other tokens: caught by the dictionary checksum recorded at training time."""
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    from fairseq_streambeam.models.block_drafter import load_drafter

    other = make_dict(30)
    other.symbols[-1] = "zzz"
    dr = random_drafter(other, 80)
    path = tmp_path / "dr.pt"
    history = [{"criterion_name": "block_drafting", "optimizer_name": "adam", "lr_scheduler_state": {"best": None},
                "num_updates": 0}]
    torch.save({"model": dr.state_dict(), "cfg": {"model": dr.build_args}, "optimizer_history": history,
                "extra_state": {"train_iterator": None}}, path)
    task = TranslationTask(TranslationConfig(), D, D)
    with pytest.raises(ValueError, match="different target dictionary"):
        load_drafter(str(path), task)
    bigger = make_dict(31)
    task = TranslationTask(TranslationConfig(), bigger, bigger)
    with pytest.raises(ValueError, match="different target dictionary"):
        load_drafter(str(path), task)


def test_deen_tiny_gad_equals_greedy():
    """The real checkpoint as verifier; a drafter of its size initialised from it (block head untrained)."""
    from fairseq_streambeam.models.block_drafter import init_from_checkpoint

    root = shared_path("models", "deen-tiny")
    models, task = load_checkpoints(root / "checkpoint_best.pt", data=root / "data-bin")
    models = [m.double() for m in models]
    d = task.target_dictionary
    task.load_dataset("test")
    ds = task.dataset("test")
    s = make_sample(d, [ds.src[i][:-1].tolist() for i in range(0, 3004, 500)])
    ref = fairseq_generate(models, d, s, beam_size=1)
    dr = random_drafter(d, 90, k=4, layers=2, dim=256)
    copied = init_from_checkpoint(dr, str(root / "checkpoint_best.pt"))
    assert copied > 20
    for n in (1, 4):
        gen = AggressiveGenerator(models, d, drafter=ModelDrafter(dr.double(), d, 4), budget=Budget(n))
        assert_same_hypos(ref, gen.generate(models, s), msg=f"budget {n}")
        assert gen.counters.accepted_per_pass > 1


def test_empty_sources_equal_greedy():
    """An empty line is its EOS alone: drafted and verified like any source (greedy's output)."""
    m = random_transformer(D, 95).double()
    s = make_sample(D, [[], [5, 6, 7], [], [8]])
    ref = fairseq_generate([m], D, s, beam_size=1, max_len_b=8)
    assert_same_hypos(ref, gad([m], s, random_drafter(D, 96).double(), n=2, max_len_b=8)[0])


def test_train_drafter_script_end_to_end(tiny_run, tmp_path):
    """scripts/train_drafter.sh on the tiny model: distil with the AR model, binarize with its
    dictionaries, train through fairseq-train; the drafter it writes decodes (= greedy)."""
    data, ckpt = tiny_run
    raw = data.parent
    small = ["--arch", "block_drafter", "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
             "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
             "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--max-update", "3",
             "--no-progress-bar"]
    r = run_cli(["bash", str(REPO / "scripts" / "train_drafter.sh"), "--model-dir", str(ckpt.parent), "--checkpoint",
                 ckpt.name, "--dict-dir", str(data), "--bpe", "none", "--train", str(raw / "train"), "--valid",
                 str(raw / "test"), "-s", "src", "-t", "tgt", "--lines", "120", "--valid-lines", "30", "--beam", "2",
                 "--block-size", "3", "--minutes", "5", "--out", str(tmp_path / "out"), "--", *small],
                cwd=str(REPO), env_extra={"PYTHON": str(BIN / "python"), "NPROC": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "120 of 120 pairs written" in r.stdout + r.stderr and "30 of 30 pairs written" in r.stdout + r.stderr
    drafter = tmp_path / "out" / "ckpt" / "checkpoint_best.pt"
    assert torch.load(drafter, weights_only=False)["cfg"]["model"].draft_block_size == 3
    base = [str(BIN / "fairseq-generate"), str(data), "--path", str(ckpt), "--user-dir", PLUGIN,
            "--task", "streambeam_translation", "--gen-subset", "test", "--beam", "1", "--cpu", "--batch-size", "16"]
    got = run_cli(base + ["--decoding", "gad", "--drafter", str(drafter)], cwd=str(REPO))
    ref = run_cli(base + ["--decoding", "greedy"], cwd=str(REPO))
    assert got.returncode == 0 and ref.returncode == 0, got.stderr[-2000:]
    tokens = [sorted(x.split("\t")[0] + x.split("\t")[2] for x in out.stdout.splitlines() if x.startswith("H-"))
              for out in (got, ref)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == N_TEST


def test_draft_budget_caps_by_estimated_reach():
    from fairseq_streambeam.runtime.draft_budget import DraftBudget

    b = DraftBudget(min_reach=0.3, prior=0.0)
    assert b.cap(8) == 8  # nothing measured yet: optimistic
    # position 0 accepted half the time, position 1 a fifth of the times it was reached
    b.update([4] * 10, [0] * 5 + [1] * 4 + [3])
    assert abs(b.acceptance(0) - 0.5) < 1e-9 and abs(b.acceptance(1) - 0.2) < 1e-9
    assert b.cap(8) == 2  # reach: 1, 0.5, 0.1 -> positions 0 and 1 are worth verifying
    assert b.cap(1) == 1 and DraftBudget(0.0).cap(5) == 5
    with pytest.raises(ValueError, match="draft-min-reach"):
        DraftBudget(1.5)


def test_adaptive_draft_cap_keeps_greedy_output_with_fewer_slots():
    m = random_transformer(D, 97, eos_bias=-2.0).double()  # long outputs: many passes to learn from
    dr = random_drafter(D, 98, k=6).double()
    s = make_sample(D, random_sentences(D, 12, 99))
    ref = fairseq_generate([m], D, s, beam_size=1, max_len_b=20)
    full = gad([m], s, dr, k=6, n=4, max_len_b=20)[1].counters
    got, gen = gad([m], s, dr, k=6, n=4, max_len_b=20, draft_min_reach=0.5)
    assert_same_hypos(ref, got)
    assert gen.counters.expansions < full.expansions  # a random drafter's drafts are rarely reached


def test_hub_interface_gad(tiny_run, tiny_drafter):
    """Python users: attach_to_hub(hub, decoding="gad", drafter=...) translates like greedy."""
    from fairseq.models.transformer import TransformerModel

    from fairseq_streambeam import attach_to_hub

    data, ckpt = tiny_run
    drafter, _ = tiny_drafter
    hub = TransformerModel.from_pretrained(str(ckpt.parent), ckpt.name, data_name_or_path=str(data),
                                           source_lang="src", target_lang="tgt")
    sents = ["w1 w2 w3", "w4", "w5 w6 w7 w8", "w9 w1", ""]
    ref = hub.translate(sents, beam=1)
    attach_to_hub(hub, decoding="gad", drafter=str(drafter))
    assert hub.translate(sents, beam=1) == ref


def test_draft_switch_uses_the_cheaper_mode_and_probes_the_other():
    sw = DraftSwitch(first_probe=2, max_probe=8)
    modes = []

    def step(cost):  # cost(drafting) -> seconds for one token
        on = sw.drafting()
        modes.append(on)
        sw.record(on, cost(on), 1)

    for _ in range(40):  # drafting costs 3x more per token: mostly without drafts, probes back off
        step(lambda on: 3.0 if on else 1.0)
    assert modes[:5] == [True, False, True, True, False]  # a second probe confirms the first, then it switches
    assert sum(modes[5:]) <= 5
    gaps = [i for i, on in enumerate(modes) if on and i > 2]
    assert gaps and all(b - a >= 3 for a, b in zip(gaps, gaps[1:]))  # the wait grows while drafting keeps losing
    modes.clear()
    for _ in range(40):  # now drafting is cheaper: the switch goes back to drafting
        step(lambda on: 0.2 if on else 1.0)
    assert sum(modes[-20:]) >= 17


def test_draft_switch_compares_seconds_per_token_over_passes_not_per_pass():
    """Drafting passes take 1.5 s and yield 1 or 5 tokens in turn (0.5 s per token); passes
    without drafts take 0.8 s per token. The switch must keep drafting: an average of each pass's
    own seconds per token (1.5 and 0.3: 0.9) would pick the passes without drafts."""
    sw = DraftSwitch(first_probe=2, max_probe=8)
    modes = []
    drafted = 0
    for _ in range(60):
        on = sw.drafting()
        modes.append(on)
        if on:
            drafted += 1
            sw.record(True, 1.5, 1 if drafted % 2 else 5)
        else:
            sw.record(False, 0.8, 1)
    assert sum(modes[-30:]) >= 26  # drafting, apart from probes


def test_draft_switch_is_not_flipped_by_one_cheap_probe():
    """Drafting is cheaper per token (1.2 s for 1.5 tokens against 1.0 s for 1), but probes of the
    passes without drafts are noisy: fast (0.5 s) and slow (1.5 s) in turn. The switch changes mode
    only after two probes in a row found the other mode cheaper, so it keeps drafting; when one
    probe decided, every fast probe sent it without drafts for a while."""
    sw = DraftSwitch(first_probe=2, max_probe=8)
    modes, probes, drafted = [], 0, 0
    for _ in range(300):
        on = sw.drafting()
        modes.append(on)
        if on:
            drafted += 1
            sw.record(True, 1.2, 3 if drafted % 4 == 0 else 1)  # 1.5 tokens per pass
        elif sw.band.mode:  # a probe while drafting
            probes += 1
            sw.record(False, 0.5 if probes % 2 else 1.5, 1)
        else:
            sw.record(False, 1.0, 1)
    assert sum(modes[-150:]) >= 130  # drafting but for probes every 8 passes (single probes deciding: 115)


def _switch_modes(sw: DraftSwitch, cost, passes: int) -> list:
    """Run `sw` for `passes` passes of one token each; `cost(drafting)` gives a pass's seconds."""
    modes = []
    for _ in range(passes):
        on = sw.drafting()
        modes.append(on)
        sw.record(on, cost(on), 1)
    return modes


def test_draft_switch_stops_drafting_only_for_a_clear_gain():
    """Passes without drafts are 5% cheaper per token than drafting passes: within the switch's
    margin for leaving drafting (10%), so it keeps drafting, apart from probes. At 30% cheaper it
    leaves drafting, and without a margin 5% is enough. Going back to drafting takes any gain."""
    assert sum(_switch_modes(DraftSwitch(first_probe=2, max_probe=8), lambda on: 1.0 if on else 0.95, 80)[-40:]) >= 34
    assert sum(_switch_modes(DraftSwitch(first_probe=2, max_probe=8), lambda on: 1.0 if on else 0.7, 80)[-40:]) <= 6
    no_margin = DraftSwitch(first_probe=2, max_probe=8, margin=0.0)
    assert sum(_switch_modes(no_margin, lambda on: 1.0 if on else 0.95, 80)[-40:]) <= 6
    sw = DraftSwitch(first_probe=2, max_probe=8)
    assert sum(_switch_modes(sw, lambda on: 3.0 if on else 1.0, 40)[-20:]) <= 4  # drafting turned off
    assert sum(_switch_modes(sw, lambda on: 0.95 if on else 1.0, 150)[-30:]) >= 25  # back on for a 5% gain


def test_draft_switch_decides_per_band_of_live_rows():
    """Drafting pays with one live row and loses with 32: interleaved passes of both sizes each
    settle on their own mode (one shared average would compare the two regimes)."""
    sw = DraftSwitch(first_probe=2, max_probe=8)
    modes: dict = {1: [], 32: []}
    for i in range(120):
        rows = 1 if i % 3 else 32
        on = sw.drafting(rows)
        modes[rows].append(on)
        per_token = (0.5 if on else 1.0) if rows == 1 else (0.3 if on else 0.1)
        sw.record(on, per_token, 1)
    assert sum(modes[1][-30:]) >= 26  # drafting, apart from probes
    assert sum(modes[32][-20:]) <= 4  # no drafts, apart from probes


class SlowDrafter(ModelDrafter):
    """A drafter that takes far longer than verification: drafting never pays off."""

    calls = 0

    def propose(self, g, caps):
        if max(caps, default=0) > 0:
            SlowDrafter.calls += 1
            time.sleep(0.02)
        return super().propose(g, caps)


def test_gad_goes_without_a_drafter_that_costs_more_than_it_brings():
    m = random_transformer(D, 90, eos_bias=-3.0).double()  # long outputs: many passes per sentence
    s = make_sample(D, random_sentences(D, 6, 91, min_len=6, max_len=12))
    kw = dict(max_len_b=20)
    ref = fairseq_generate([m], D, s, beam_size=1, **kw)
    for n in (1, 3):
        SlowDrafter.calls = 0
        gen = AggressiveGenerator([m], D, drafter=SlowDrafter(random_drafter(D, 92).double(), D, 3),
                                  budget=Budget(n), decoding="gad", **kw)
        assert_same_hypos(ref, gen.generate([m], s))
        assert SlowDrafter.calls < 0.5 * gen.counters.decoder_steps  # most passes went without drafts


def test_gad_plus_plus_never_switches_drafting_off():
    """GAD++'s output depends on the drafts, so on which passes draft: it always drafts."""
    m = random_transformer(D, 93)
    dr = ModelDrafter(random_drafter(D, 94), D)
    assert AggressiveGenerator([m], D, drafter=dr, decoding="gad", gad_beta=3).draft_switch is None
    assert AggressiveGenerator([m], D, drafter=dr, decoding="gad").draft_switch is not None


def test_gad_without_a_drafter_object_is_refused():
    """A generator built directly cannot read --drafter/--draft-lookup files (the task does): gad
    without `drafter=` is refused, not decoded with IAD's input copy."""
    m = random_transformer(D, 95)
    for kw in ({}, {"draft_lookup": "targets.txt"}):
        with pytest.raises(UsageError, match="needs drafter="):
            AggressiveGenerator([m], D, decoding="gad", **kw)


@pytest.mark.parametrize("bad", [["--minutes", "0"], ["--minutes", "abc"], ["--lines", "-1"], ["--valid-lines", "x"],
                                 ["--beam", "0"], ["--block-size", "x"], ["--bpe", "fastbpe"]])
def test_train_drafter_script_refuses_bad_values_in_one_line(tmp_path, bad):
    """A time limit of 0 or a word used to reach fairseq-train as no limit at all; every count is
    checked before anything runs or is written."""
    r = run_cli(["bash", str(REPO / "scripts" / "train_drafter.sh"), "--model-dir", str(tmp_path / "none"), "--out",
                 str(tmp_path / "out"), *bad],
                cwd=str(REPO))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and bad[0] in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
