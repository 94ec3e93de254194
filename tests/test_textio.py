"""Raw text as the front ends encode it (textio.TextCodec: decode_corpus, the bench's --src, the server)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from fairseq.data import Dictionary

from fairseq_streambeam.textio import TextCodec, read_lines


def test_moses_tokenizes_the_source_with_its_own_languages_rules():
    """As fairseq-interactive: a German source is tokenized with German Moses rules (an ordinal's dot
    stays on the number), and output is detokenized with the target language's."""
    pytest.importorskip("sacremoses", reason="sacremoses: pip install -e '.[test]'")
    d = Dictionary()
    for w in "Er kam am 3. 3 Oktober . He came on 3rd October".split():
        d.add_symbol(w)
    task = SimpleNamespace(cfg=SimpleNamespace(source_lang="de", target_lang="en"), source_dictionary=d,
                           target_dictionary=d)
    codec = TextCodec(task, "moses", "none", None, None)
    assert d.string(codec.encode("Er kam am 3. Oktober.")) == "Er kam am 3. Oktober ."
    assert codec.decode(d.encode_line("He came on 3rd October .", add_if_not_exist=False).tolist()) == \
        "He came on 3rd October."


def test_text_files_split_at_newlines_only(tmp_path):
    """A \\x85 inside a sentence (real training text has them) does not shift the sentence ids, in
    the bench's raw sources and references as in LMBR evidence files."""
    from fairseq_streambeam.scorers.build_posteriors import read_evidence

    f = tmp_path / "ref.txt"
    f.write_text("He said\x85 no.\r\nYes.\rNo.\n", encoding="utf-8")
    assert read_lines(f) == ["He said\x85 no.", "Yes.\rNo."]  # as decode_corpus splits its input
    ev = tmp_path / "n.txt"
    ev.write_text("a\x85b\nc\n", encoding="utf-8")
    assert len(read_evidence(str(ev), "text", 1)) == 2


def test_bench_references_escape_unk_as_fairseq_generate(tmp_path):
    """A reference's <unk> is printed as fairseq-generate's T- line prints it (<<unk>>), so a
    hypothesis's <unk> never counts as a match."""
    from fairseq.data import LanguagePairDataset

    from fairseq_streambeam.bench.data import from_data_bin

    d = Dictionary()
    for w in "a b".split():
        d.add_symbol(w)
    src, tgt = [d.encode_line("a b", add_if_not_exist=False)], [torch.tensor([d.index("a"), d.unk(), d.eos()])]
    ds = LanguagePairDataset(src, [3], d, tgt, [3], d)
    task = SimpleNamespace(load_dataset=lambda s: None, dataset=lambda s: ds, source_dictionary=d, target_dictionary=d)
    assert from_data_bin(task, "test", 0, None).refs == ["a <<unk>>"]


def test_calibrate_tokenizes_evidence_in_the_target_language(tmp_path):
    """streambeam-calibrate segments LMBR evidence (target text) with --target-lang's Moses rules."""
    pytest.importorskip("sacremoses", reason="sacremoses: pip install -e '.[test]'")
    from fairseq_streambeam.calibrate import parse_args
    from fairseq_streambeam.scorers.build_posteriors import load_evidence

    ev = tmp_path / "n.txt"
    ev.write_text("Am 3. Oktober.\n", encoding="utf-8")
    d = Dictionary()
    for w in "Am 3. Oktober .".split():
        d.add_symbol(w)
    a = parse_args(["--data", str(tmp_path), "--path", "m.pt", "-s", "en", "-t", "de", "--tokenizer", "moses",
                    "--nbest", str(ev), "--n", "1"])
    _, summary = load_evidence(a, d)
    assert summary.endswith("; 0 of 4 evidence units not in the dictionary (mapped to unk)")  # "3" would be one


def test_evidence_mostly_outside_the_dictionary_asks_for_segmentation(tmp_path):
    """Raw text given as evidence for a subword model maps most units to unk: the summary says so
    and names the segmentation options; evidence in the model's units does not get the hint."""
    from fairseq_streambeam.scorers.build_posteriors import UNKNOWN_SHARE, add_evidence_args, load_evidence

    d = Dictionary()
    for w in "▁the ▁cat".split():
        d.add_symbol(w)
    p = argparse.ArgumentParser()
    add_evidence_args(p)
    for text, hinted in (("▁the ▁cat\n", False), ("the cat\n", True)):
        (tmp_path / "n.txt").write_text(text, encoding="utf-8")
        _, summary = load_evidence(p.parse_args(["--nbest", str(tmp_path / "n.txt"), "--n", "1"]), d)
        assert summary.endswith(f"more than {UNKNOWN_SHARE:.0%}; segment the evidence as the model's text "
                                "(--tokenizer, --bpe)") == hinted, summary


def test_distill_pairs_lines_split_at_newlines_only(tmp_path):
    """A lone carriage return inside a source line keeps the pairing (it was a line break to
    Python's universal newlines, shifting every later pair)."""
    from fairseq_streambeam.drafters.distill import main

    (tmp_path / "src").write_bytes(b"a\rb\nc d\n")
    (tmp_path / "hyp").write_bytes(b"A B\nC D\n")
    assert main(["--src", str(tmp_path / "src"), "--hyp", str(tmp_path / "hyp"), "--out-prefix",
                 str(tmp_path / "out/train"), "-s", "de", "-t", "en", "--bpe", "none"]) == 0
    assert (tmp_path / "out/train.en").read_text().split("\n") == ["A B", "C D", ""]
    assert (tmp_path / "out/train.de").read_bytes().split(b"\n")[1] == b"c d"


@pytest.mark.parametrize("case, expected", [
    ("missing", "cannot read"), ("same-langs", "-s and -t name the same file suffix"),
    ("no-spm", "needs --sentencepiece-model"), ("spm-missing", "no sentencepiece model at"),
    ("out-unwritable", "cannot write"), ("count", "has 2 lines but"),
])
def test_distill_usage_mistakes_are_one_line_and_write_nothing(tmp_path, capsys, case, expected):
    from fairseq_streambeam.drafters.distill import main

    (tmp_path / "src").write_text("a b\nc d\n")
    (tmp_path / "hyp").write_text("A B\n" if case == "count" else "A B\nC D\n")
    (tmp_path / "file").write_text("")
    args = {"--src": str(tmp_path / ("nope" if case == "missing" else "src")), "--hyp": str(tmp_path / "hyp"),
            "--out-prefix": str(tmp_path / ("file/x" if case == "out-unwritable" else "out/train")),
            "-s": "en" if case == "same-langs" else "de", "-t": "en", "--bpe": "none"}
    if case in ("no-spm", "spm-missing"):
        args["--bpe"] = "sentencepiece"
    if case == "spm-missing":
        args["--sentencepiece-model"] = str(tmp_path / "nope.model")
    with pytest.raises(SystemExit) as e:
        main([x for kv in args.items() for x in kv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()
