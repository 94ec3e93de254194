"""Raw text as the front ends encode it (textio.TextCodec: decode_corpus, the bench's --src, the server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fairseq.data import Dictionary

from fairseq_streambeam.textio import TextCodec


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
