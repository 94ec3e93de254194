"""Checkpoints in the format of fairseq's published WMT'19 De-En and Ru-En ensembles.

The fixture writes a small two-model ensemble the way those archives hold theirs:
`transformer_wmt_en_de_big` with the flags those checkpoints carry (shared decoder input/output
embeddings; all embeddings shared over the joined De-En dictionary, separate Ru-En dictionaries; an
encoder FFN twice the decoder's, as published) at tiny dimensions; fairseq-0.x checkpoints (a dict
with an `args` Namespace of that time's option names and `model`, state-dict keys spelled as before
fairseq 0.8: combined `in_proj` attention weights, numbered `layer_norms`, no `output_projection`;
the second member in half precision), which fairseq's checkpoint_utils upgrades on load;
`dict.{src,tgt}.txt`; `bpecodes` for fastBPE; Moses tokenization. The weights are trained for a few
steps on ten sentence pairs so that outputs vary and end. Then:

- it loads through `TransformerModel.from_pretrained(..., checkpoint_file='model1.pt:model2.pt',
  bpe='fastbpe', tokenizer='moses')` with the weights that were written, and after `attach_to_hub`
  `.translate()` works with every decoding: `beam` and `fixed-stream` print what fairseq's own hub
  prints, greedy, iad and gad (lookup drafts) what fairseq's greedy prints, var-stream var-batch's;
- scripts/reproduce_wmt19.sh fetches a tar.gz of it with fairseq's hub download code (from an HTTP
  server on localhost, `--model-url`) or from a local archive, and benchmarks the ensemble.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import http.server
import json
import tarfile
import threading
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel
from helpers import BIN, REPO, assert_same_hypos, run_cli

from fairseq_streambeam import attach_to_hub
from fairseq_streambeam.drafters.input_copy import InputCopyDrafter

# A little parallel text: what the codes and dictionaries are learned from, and what is translated.
TEXT = {
    "de": ["Das Haus ist klein und alt.", "Der Hund läuft schnell über die Straße.",
           "Wir haben heute keine Zeit für lange Gespräche.",
           "Die Regierung hat am Montag neue Gesetze beschlossen.",
           "Ich trinke gern Kaffee mit Milch und Zucker.", "Das Wetter war gestern in Berlin sehr schön.",
           "Die Kinder spielen im Garten, während die Eltern kochen.",
           "Der Zug nach München hat 20 Minuten Verspätung.",
           "„Wir werden sehen“, sagte der Minister.", "Die Preise sind im letzten Jahr um 3,5 Prozent gestiegen."],
    "ru": ["Дом маленький и старый.", "Собака быстро бежит через улицу.",
           "Сегодня у нас нет времени на долгие разговоры.",
           "В понедельник правительство приняло новые законы.", "Я люблю кофе с молоком и сахаром.",
           "Вчера в Москве была очень хорошая погода.", "Дети играют в саду, пока родители готовят.",
           "Поезд в Петербург опаздывает на 20 минут.", "«Посмотрим», — сказал министр.",
           "За последний год цены выросли на 3,5 процента."],
    "en": ["The house is small and old.", "The dog runs quickly across the street.",
           "Today we have no time for long conversations.", "The government passed new laws on Monday.",
           "I like coffee with milk and sugar.", "Yesterday the weather in the capital was very nice.",
           "The children play in the garden while the parents cook.", "The train is 20 minutes late.",
           "\"We will see,\" said the minister.", "Prices rose by 3.5 percent last year."],
}
PAIRS = {"de-en": True, "ru-en": False}  # pair -> joined dictionary with all embeddings shared (as published)
CHECKPOINTS = "model1.pt:model2.pt"
DIM, LAYERS = 32, 2


def learn_bpe(words: collections.Counter, merges: int) -> List[Tuple[str, str, int]]:
    """Sennrich et al.'s BPE over word counts, as fastBPE learns it: symbols are characters with
    `</w>` on a word's last one; each step merges the most frequent adjacent pair."""
    vocab = {tuple(w[:-1]) + (w[-1] + "</w>",): c for w, c in words.items()}
    codes = []
    for _ in range(merges):
        pairs: collections.Counter = collections.Counter()
        for sym, c in vocab.items():
            for pair in zip(sym, sym[1:]):
                pairs[pair] += c
        if not pairs:
            break
        (a, b), count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if count < 2:
            break
        codes.append((a, b, count))
        merged = {}
        for sym, c in vocab.items():
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            merged[tuple(out)] = c
        vocab = merged
    return codes


def legacy_args(src: str, tgt: str, joined: bool) -> argparse.Namespace:
    """The `args` of a published WMT'19 checkpoint (fairseq 0.6-0.7 option names and types: data as
    a list, left_pad_source as a string, min_lr, relu_dropout), at tiny dimensions."""
    return argparse.Namespace(
        adam_betas="(0.9, 0.98)", adam_eps=1e-08, adaptive_input=False, adaptive_softmax_cutoff=None,
        adaptive_softmax_dropout=0, arch="transformer_wmt_en_de_big", attention_dropout=0.1, bucket_cap_mb=25,
        clip_norm=0.0, cpu=False, criterion="label_smoothed_cross_entropy",
        data=[f"/data/wmt19/{src}{tgt}", f"/data/wmt19/finetune/{src}{tgt}"], ddp_backend="c10d",
        decoder_attention_heads=2, decoder_embed_dim=DIM, decoder_embed_path=None, decoder_ffn_embed_dim=2 * DIM,
        decoder_input_dim=DIM, decoder_layers=LAYERS, decoder_learned_pos=False, decoder_normalize_before=False,
        decoder_output_dim=DIM, device_id=0, distributed_backend="nccl",
        distributed_init_method="tcp://localhost:17406", distributed_port=-1, distributed_rank=0,
        distributed_world_size=2, dropout=0.2, encoder_attention_heads=2, encoder_embed_dim=DIM,
        encoder_embed_path=None, encoder_ffn_embed_dim=4 * DIM, encoder_layers=LAYERS, encoder_learned_pos=False,
        encoder_normalize_before=False, fix_batches_to_gpus=False, fp16=True, fp16_init_scale=128,
        fp16_scale_window=None, keep_interval_updates=-1, label_smoothing=0.1, lazy_load=False,
        left_pad_source="True", left_pad_target="False", log_format="simple", log_interval=100, lr=[0.0007],
        lr_scheduler="inverse_sqrt", lr_shrink=0.1, max_epoch=0, max_sentences=None, max_sentences_valid=None,
        max_source_positions=1024, max_target_positions=1024, max_tokens=3584, max_update=0, min_loss_scale=0.0001,
        min_lr=1e-09, momentum=0.99, no_epoch_checkpoints=False, no_progress_bar=True, no_save=False,
        no_token_positional_embeddings=False, optimizer="adam", optimizer_overrides="{}", raw_text=False,
        relu_dropout=0.0, reset_lr_scheduler=False, reset_optimizer=False, restore_file="checkpoint_last.pt",
        save_dir="checkpoints", save_interval=1, save_interval_updates=0, seed=1, sentence_avg=False,
        share_all_embeddings=joined, share_decoder_input_output_embed=True,
        skip_invalid_size_inputs_valid_test=False, source_lang=src, target_lang=tgt, task="translation",
        train_subset="train", update_freq=[16], upsample_primary=1, valid_subset="valid", validate_interval=1,
        warmup_init_lr=1e-07, warmup_updates=4000, weight_decay=0.0,
    )


class _Dicts:
    def __init__(self, src_dict: Dictionary, tgt_dict: Dictionary):
        self.source_dictionary, self.target_dictionary = src_dict, tgt_dict


def train(model, src_dict: Dictionary, tgt_dict: Dictionary, pairs: List[Tuple[str, str]], steps: int,
          lr: float = 3e-3):
    """A few full-batch Adam steps on the segmented `pairs`, so that outputs differ by sentence and
    end (a random model repeats one token until the length limit)."""
    batch = [(src_dict.encode_line(s, add_if_not_exist=False), tgt_dict.encode_line(t, add_if_not_exist=False))
             for s, t in pairs]
    pad, eos = tgt_dict.pad(), tgt_dict.eos()
    n_src, n_tgt = max(len(s) for s, _ in batch), max(len(t) for _, t in batch)
    src = torch.full((len(batch), n_src), pad)
    tgt = torch.full((len(batch), n_tgt), pad)
    prev = torch.full((len(batch), n_tgt), pad)
    for i, (s, t) in enumerate(batch):
        src[i, n_src - len(s):] = s  # left-padded sources, as fairseq's translation task
        tgt[i, :len(t)] = t
        prev[i, 0] = eos
        prev[i, 1:len(t)] = t[:-1]
    lengths = (src != pad).sum(1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits, _ = model(src, lengths, prev)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=pad, label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def build(args: argparse.Namespace, src_dict: Dictionary, tgt_dict: Dictionary, seed: int):
    from fairseq.models.transformer.transformer_legacy import transformer_wmt_en_de_big

    torch.manual_seed(seed)
    built = argparse.Namespace(**vars(args))
    transformer_wmt_en_de_big(built)
    return TransformerModel.build_model(built, _Dicts(src_dict, tgt_dict))


def legacy_state_dict(model, half: bool) -> Dict[str, torch.Tensor]:
    """`model`'s weights under the key names of fairseq before 0.8."""
    out = {}
    sd = model.state_dict()
    for k, v in sd.items():
        if k.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            continue
        if k == "decoder.output_projection.weight" or k.endswith("version"):
            continue
        if ".q_proj." in k:
            base, kind = k.split(".q_proj.")
            out[f"{base}.in_proj_{kind}"] = torch.cat([v, sd[f"{base}.k_proj.{kind}"], sd[f"{base}.v_proj.{kind}"]])
            continue
        for stack, names in (("encoder", ("self_attn_layer_norm", "final_layer_norm")),
                             ("decoder", ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"))):
            if k.startswith(f"{stack}.layers."):
                for i, name in enumerate(names):
                    k = k.replace(f".{name}.", f".layer_norms.{i}.")
        out[k] = v.clone()
    if half:
        out = {k: v.half() for k, v in out.items()}
    out["encoder.version"] = torch.tensor([2.0])
    out["decoder.version"] = torch.tensor([2.0])
    return out


def write_wmt19_dir(root: Path, pair: str) -> dict:
    """The files of a WMT'19 ensemble archive for `pair` under `root`; returns what the test
    compares against (the models as built)."""
    import fastBPE
    from sacremoses import MosesTokenizer

    src, tgt = pair.split("-")
    joined = PAIRS[pair]
    root.mkdir(parents=True, exist_ok=True)
    tok = {lang: [MosesTokenizer(lang=lang).tokenize(s, return_str=True, escape=True) for s in TEXT[lang]]
           for lang in (src, tgt)}
    words = collections.Counter(w for lang in (src, tgt) for line in tok[lang] for w in line.split())
    codes = learn_bpe(words, 150)
    (root / "bpecodes").write_text("".join(f"{a} {b} {c}\n" for a, b, c in codes), encoding="utf-8")
    bpe = fastBPE.fastBPE(str(root / "bpecodes"))
    seg = {lang: bpe.apply(tok[lang]) for lang in (src, tgt)}

    def dictionary(*langs: str) -> Dictionary:
        d = Dictionary()
        for lang in langs:
            for line in seg[lang]:
                for w in line.split():
                    d.add_symbol(w)
        d.finalize(padding_factor=8)  # fairseq-preprocess pads with madeupwordNNNN to a multiple of 8
        return d

    if joined:
        src_dict = tgt_dict = dictionary(src, tgt)
    else:
        src_dict, tgt_dict = dictionary(src), dictionary(tgt)
    src_dict.save(str(root / f"dict.{src}.txt"))
    tgt_dict.save(str(root / f"dict.{tgt}.txt"))
    (root / f"lookup.{tgt}").write_text("\n".join(seg[tgt]) + "\n", encoding="utf-8")

    args = legacy_args(src, tgt, joined)
    pairs = list(zip(seg[src], seg[tgt]))
    model = train(build(args, src_dict, tgt_dict, seed=1), src_dict, tgt_dict, pairs, steps=100)
    models = []
    for i, name in enumerate(CHECKPOINTS.split(":")):
        if i:  # the next member: a later checkpoint of the run, saved from fp16 training in half precision
            model = train(copy.deepcopy(model), src_dict, tgt_dict, pairs, steps=15).half().float()
        torch.save({
            "args": args,
            "model": legacy_state_dict(model, half=i > 0),
            "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                                   "optimizer_name": "FP16Optimizer", "lr_scheduler_state": {"best": 3.9},
                                   "num_updates": 10000 + i}],
            "extra_state": {"epoch": 8, "val_loss": 3.9, "train_iterator": {"epoch": 8, "iterations_in_epoch": 0}},
        }, root / name)
        models.append(model)
    return {"dir": root, "models": models, "src": src, "tgt": tgt, "joined": joined}


# Translated besides the trained sentences: words the codes never saw, and a few of their words.
UNSEEN = {"de": ["Völlig unbekannte Wörter: Xylophon!", "Das Haus und der Hund."],
          "ru": ["Совсем незнакомые слова: ксилофон!", "Дом и собака."],
          "en": ["Completely unknown words: xylophone!", "The house and the dog."]}


def sentences(lang: str) -> List[str]:
    return TEXT[lang] + UNSEEN[lang]


@pytest.fixture(scope="module")
def wmt19(tmp_path_factory):
    """pair -> the written archive directory and the models as built (each pair made once)."""
    pytest.importorskip("fastBPE", reason="fastBPE: pip install cython setuptools wheel && "
                                          "pip install --no-build-isolation fastBPE==0.1.0")
    pytest.importorskip("sacremoses", reason="sacremoses: pip install -e '.[test]'")
    root = tmp_path_factory.mktemp("wmt19")
    made: Dict[str, dict] = {}

    def get(pair: str) -> dict:
        if pair not in made:
            made[pair] = write_wmt19_dir(root / pair, pair)
        return made[pair]

    return get


@pytest.fixture(scope="module")
def hubs(wmt19):
    """pair -> (hub loaded as fairseq's hub table loads the WMT'19 models, its own task, what stock
    fairseq's hub outputs: beam 5 and greedy strings, beam 5 hypotheses)."""
    loaded: Dict[str, tuple] = {}

    def get(pair: str):
        if pair not in loaded:
            made = wmt19(pair)
            d = made["dir"]
            hub = TransformerModel.from_pretrained(str(d), checkpoint_file=CHECKPOINTS, data_name_or_path=".",
                                                   bpe="fastbpe", bpe_codes=str(d / "bpecodes"), tokenizer="moses")
            src = sentences(made["src"])
            stock = {"beam": hub.translate(src, beam=5), "greedy": hub.translate(src, beam=1),
                     "hypos": hub.generate([hub.encode(x) for x in src], beam=5)}
            loaded[pair] = (hub, hub.task, stock)
        return loaded[pair]

    return get


def translate(hub, stock_task, src: List[str], beam: int, **options) -> List[str]:
    hub.task = stock_task  # each decoding attached to the stock task, as to a freshly loaded hub
    attach_to_hub(hub, **options)
    return hub.translate(src, beam=beam)


@pytest.mark.parametrize("pair", PAIRS)
def test_checkpoints_load_through_fairseq_hub_as_written(hubs, wmt19, pair):
    hub, _, stock = hubs(pair)
    made = wmt19(pair)
    cfg = hub.cfg.model
    assert len(hub.models) == 2 and cfg.arch == "transformer_wmt_en_de_big"
    assert cfg.share_decoder_input_output_embed and cfg.share_all_embeddings is made["joined"]
    assert cfg.encoder_ffn_embed_dim == 4 * DIM and cfg.decoder_ffn_embed_dim == 2 * DIM
    for got_model, want_model in zip(hub.models, made["models"]):
        got, want = got_model.state_dict(), want_model.state_dict()
        assert set(got) == set(want)
        for k in want:
            if not k.endswith("version"):  # fairseq's upgrade marks old checkpoints as version 1
                assert torch.equal(got[k], want[k]), k
        dec = got_model.decoder
        assert dec.output_projection.weight is dec.embed_tokens.weight
        assert (got_model.encoder.embed_tokens is dec.embed_tokens) is made["joined"]
    # Moses and fastBPE as the hub table says: subwords, no unknown words in the trained sentences
    src = TEXT[made["src"]]
    assert all(hub.src_dict.unk() not in hub.encode(x).tolist() for x in src)
    assert "@@" in hub.apply_bpe(hub.tokenize(src[1]))
    # the trained sentences come out as trained (detokenized text, as a WMT'19 model's)
    assert sum(h == r for h, r in zip(stock["beam"], TEXT["en"])) >= 7, stock["beam"]


@pytest.mark.parametrize("pair", PAIRS)
def test_beam_is_fairseqs_hub_output(hubs, pair):
    hub, stock_task, stock = hubs(pair)
    src = sentences(pair.split("-")[0])
    assert translate(hub, stock_task, src, 5, decoding="beam") == stock["beam"]
    assert_same_hypos(hub.generate([hub.encode(x) for x in src], beam=5), stock["hypos"])
    assert translate(hub, stock_task, src, 5, decoding="fixed-stream") == stock["beam"]


@pytest.mark.parametrize("pair", PAIRS)
def test_greedy_iad_and_gad_print_fairseq_greedy(hubs, wmt19, pair):
    hub, stock_task, stock = hubs(pair)
    made = wmt19(pair)
    src = sentences(made["src"])
    assert stock["greedy"] != stock["beam"]  # the model is uncertain enough for greedy to differ
    assert translate(hub, stock_task, src, 1, decoding="greedy") == stock["greedy"]
    assert translate(hub, stock_task, src, 1, decoding="iad") == stock["greedy"]
    lookup = made["dir"] / f"lookup.{made['tgt']}"
    assert translate(hub, stock_task, src, 1, decoding="gad", draft_lookup=str(lookup)) == stock["greedy"]


def test_iad_copies_source_tokens_as_the_target_tokens_they_spell():
    """With separate dictionaries (Ru-En) IAD drafts target ids: the task maps each source id to
    the target id of the same symbol (unk where the target has none)."""
    dr = InputCopyDrafter(block_size=0, vocab_map=[0, 1, 2, 3, 7, 3, 5])
    assert dr.draft(dr.start([4, 6, 5, 2])) == [7, 5, 3, 2]
    assert InputCopyDrafter().start([4, 6, 2]).src == [4, 6, 2]  # one dictionary: the source as it is


@pytest.mark.parametrize("pair", PAIRS)
def test_variable_width_beams(hubs, pair):
    hub, stock_task, stock = hubs(pair)
    src = sentences(pair.split("-")[0])
    var_batch = translate(hub, stock_task, src, 5, decoding="var-batch")
    assert translate(hub, stock_task, src, 5, decoding="var-stream") == var_batch
    # pruned beams keep the best path where the model is sure: the trained sentences
    assert sum(v == b for v, b in zip(var_batch[:len(TEXT["en"])], stock["beam"])) >= 8


# ---- scripts/reproduce_wmt19.sh on an archive of the ensemble ------------------------------------


def make_archive(made: dict, dest: Path, name: str) -> Path:
    """A tar.gz as published: one top directory with the checkpoints, dictionaries and bpecodes."""
    d, src, tgt = made["dir"], made["src"], made["tgt"]
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / f"{name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(d, arcname=name, recursive=False)
        for f in [*CHECKPOINTS.split(":"), f"dict.{src}.txt", f"dict.{tgt}.txt", "bpecodes"]:
            tar.add(d / f, arcname=f"{name}/{f}")
    return archive


@pytest.fixture
def http_server(tmp_path) -> Iterator[Tuple[str, Path, List[str]]]:
    """A local HTTP server: (base URL, the directory it serves, the request lines it received)."""
    root = tmp_path / "served"
    root.mkdir()
    seen: List[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_request(self, code="-", size="-"):
            seen.append(f"{self.command} {self.path} {code}")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, seen
    finally:
        server.shutdown()
        server.server_close()


def reproduce(tmp_path: Path, pair: str, *args: str):
    """The script on the pair's sentences, every method once; returns (process, results.json)."""
    src, tgt = pair.split("-")
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "src").write_text("\n".join(sentences(src)) + "\n", encoding="utf-8")
    (tmp_path / "ref").write_text("\n".join(sentences(tgt)) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    r = run_cli(["bash", str(REPO / "scripts" / "reproduce_wmt19.sh"), "--pair", pair, *args,
                 "--checkpoints", CHECKPOINTS, "--src", str(tmp_path / "src"), "--ref", str(tmp_path / "ref"),
                 "--config", str(REPO / "configs" / "paper_k5.json"), "--repeats", "1", "--out", str(out),
                 "--", "--quiet", "--no-plots"],
                cwd=str(tmp_path), env_extra={"PYTHON": str(BIN / "python"),
                                              "PYTORCH_FAIRSEQ_CACHE": str(tmp_path / "cache")})
    doc = json.loads((out / "results.json").read_text()) if r.returncode == 0 else None
    return r, doc


def check_results(doc: dict, stock: dict, pair: str, model_dir: Path) -> None:
    """Both checkpoints of the fetched directory decoded, and `beam` printed what fairseq's hub prints."""
    import sacrebleu

    paths = doc["path"].split(":")
    assert [Path(p).name for p in paths] == CHECKPOINTS.split(":") and all(Path(p).parent == model_dir for p in paths)
    rows = {row["method"]: row for row in doc["rows"]}
    assert list(rows) == ["greedy", "beam", "var-batch", "var-stream"]
    refs = [sentences(pair.split("-")[1])]
    assert rows["beam"]["bleu"] == round(sacrebleu.corpus_bleu(stock["beam"], refs).score, 2)
    assert rows["greedy"]["bleu"] == round(sacrebleu.corpus_bleu(stock["greedy"], refs).score, 2)
    assert rows["beam"]["bleu"] > 50  # Moses, fastBPE and detokenization wired as the hub does


def test_reproduce_script_fetches_the_archive_over_http(wmt19, hubs, http_server, tmp_path):
    """The online path with fairseq's hub download code (requests, its cache, its extraction);
    only the URL is local."""
    pytest.importorskip("requests", reason="requests: pip install -e '.[wmt19]'")
    url, served, seen = http_server
    name = "wmt19.de-en.joined-dict.ensemble"
    make_archive(wmt19("de-en"), served, name)
    r, doc = reproduce(tmp_path, "de-en", "--model-url", f"{url}/{name}.tar.gz")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"GET /{name}.tar.gz 200" in seen
    cached = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # fairseq extracts in its cache
    assert len(cached) == 1
    check_results(doc, hubs("de-en")[2], "de-en", cached[0])


def test_reproduce_script_takes_a_local_archive(wmt19, hubs, tmp_path):
    """--model-url with a file:// URL: the archive is extracted from a copy (fairseq's
    load_archive_file would replace the archive by its directory); errors are one line."""
    name = "wmt19.ru-en.ensemble"
    archive = make_archive(wmt19("ru-en"), tmp_path / "archives", name)
    r, doc = reproduce(tmp_path, "ru-en", "--model-url", archive.as_uri())
    assert r.returncode == 0, r.stderr[-3000:]
    assert archive.is_file()
    check_results(doc, hubs("ru-en")[2], "ru-en", tmp_path / "out" / "archive" / f"{name}.tar.gz")

    (tmp_path / "bad.tar.gz").write_text("not an archive")
    for url, message in ((archive.with_name("missing.tar.gz").as_uri(), "no archive at"),
                         ((tmp_path / "bad.tar.gz").as_uri(), "cannot fetch")):
        r, _ = reproduce(tmp_path / "err", "ru-en", "--model-url", url)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith(f"reproduce_wmt19.sh: {message}"), r.stderr[-2000:]
