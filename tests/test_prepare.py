"""data/prepare.py on local files, through the same `datasets` path as hub datasets (offline:
see the offline_hugging_face fixture in conftest.py)."""

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data.corpus as prepare_module
import data.sources as sources_module
from data.corpus import CORPUS_DIR, in_val, prepare, split_long
from data.loader import TokenDataset
from data.sources import Corpus, local_files, open_corpus, open_text_file
from data.tokenizer import END_OF_TEXT, CharTokenizer, GPT2Tokenizer, tokenizer_from_meta, train_bpe
from errors import UserError
from tests.conftest import PROJECT_ROOT, run_entry_point, run_script

# pyarrow comes with datasets, which preparing local and hub corpora needs; a machine without them
# (a GPU image) runs every other test. (datasets itself must not be imported before conftest's
# offline_hugging_face fixture has run.)
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CORPUS = (CORPUS_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")
# 40 documents of different lengths, some with text beyond ASCII
DOCUMENTS = [CORPUS[i * 20_000 : i * 20_000 + 300 + 97 * i] + ("" if i % 3 else " naïve, 東京 🙂") for i in range(40)]
FORMATS = ("txt", "jsonl", "json", "parquet")


def write_corpus(folder, fmt, documents=DOCUMENTS):
    """The documents as a folder of .txt files (one per document) or one file of rows."""
    folder.mkdir()
    if fmt == "txt":
        for i, text in enumerate(documents):
            (folder / f"doc{i:03}.txt").write_text(text, encoding="utf-8")
        return folder
    path = folder / f"corpus.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"id": i, "text": text}) + "\n" for i, text in enumerate(documents)))
    elif fmt == "json":
        path.write_text(json.dumps([{"id": i, "text": text} for i, text in enumerate(documents)]))
    else:
        pq.write_table(pa.table({"id": range(len(documents)), "text": documents}), path)
    return path


def prepare_local(path, out, tokenizer="gpt2", **options):
    streaming = options.pop("streaming", False)
    options = {"val_fraction": 0.25, "block_size": 16} | options
    return prepare(open_corpus(str(path), streaming=streaming), tokenizer, out, **options)


def read_splits(out):
    dataset = TokenDataset(out)
    return dataset, {split: dataset.tokens(split) for split in ("train", "val")}


@pytest.mark.parametrize("fmt", FORMATS)
def test_token_count_is_tiktokens_plus_one_separator_per_document(fmt, tmp_path):
    meta = prepare_local(write_corpus(tmp_path / "corpus", fmt), tmp_path / "out")
    encoding = GPT2Tokenizer().encoding
    expected = sum(len(ids) for ids in encoding.encode_ordinary_batch(DOCUMENTS)) + len(DOCUMENTS)
    assert meta["train_tokens"] + meta["val_tokens"] == expected
    assert meta["documents"] == len(DOCUMENTS) and meta["separator"] == END_OF_TEXT
    assert meta["train_bytes"] + meta["val_bytes"] == sum(len(text.encode("utf-8")) for text in DOCUMENTS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prepared_splits_decode_back_to_the_documents(fmt, tmp_path):
    prepare_local(write_corpus(tmp_path / "corpus", fmt), tmp_path / "out", seed=7)
    dataset, tokens = read_splits(tmp_path / "out")
    tokenizer = tokenizer_from_meta(dataset.meta)
    for split, is_val in (("train", False), ("val", True)):
        decoded = tokenizer.decode(tokens[split].tolist()).split(END_OF_TEXT)
        assert decoded[-1] == ""  # every document, the last included, ends with the separator
        expected = [text for i, text in enumerate(DOCUMENTS) if in_val(i, 7, 0.25) == is_val]
        assert decoded[:-1] == expected and expected


def test_val_documents_depend_on_the_seed(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", "jsonl")
    val_sets = [{i for i in range(len(DOCUMENTS)) if in_val(i, seed, 0.25)} for seed in (1, 2)]
    assert val_sets[0] != val_sets[1]
    for seed in (1, 2):
        prepare_local(corpus, tmp_path / f"seed{seed}", seed=seed)
    assert (tmp_path / "seed1" / "val.bin").read_bytes() != (tmp_path / "seed2" / "val.bin").read_bytes()


def test_output_is_the_same_for_any_num_proc_job_size_and_streaming(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", "jsonl")
    prepare_local(corpus, tmp_path / "one", num_proc=1)
    monkeypatch.setattr(prepare_module, "JOB_CHARS", 1000)  # many small jobs in flight at once
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 300)  # long documents cut into pieces
    prepare_local(corpus, tmp_path / "two", num_proc=2)
    prepare_local(corpus, tmp_path / "streamed", num_proc=2, streaming=True)
    for name in ("train.bin", "val.bin", "meta.json"):
        reference = (tmp_path / "one" / name).read_bytes()
        assert (tmp_path / "two" / name).read_bytes() == reference
        assert (tmp_path / "streamed" / name).read_bytes() == reference


def test_long_text_is_cut_only_where_gpt2_tokens_do_not_change(monkeypatch):
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 200)
    text = CORPUS[:100_000] + " " * 5 + "a  b\n\n c 12 x's, 'twas " * 50
    pieces = split_long(text)
    assert len(pieces) > 400 and "".join(pieces) == text
    encoding = GPT2Tokenizer().encoding
    assert sum(encoding.encode_ordinary_batch(pieces), []) == encoding.encode_ordinary(text)
    assert split_long("x" * 1000) == ["x" * 1000]  # no space to cut at: kept whole


def test_end_of_text_in_a_document_is_plain_text(tmp_path):
    documents = [f"story {i} <|endoftext|> goes on" for i in range(40)]
    prepare_local(write_corpus(tmp_path / "corpus", "jsonl", documents), tmp_path / "out", block_size=4)
    _, tokens = read_splits(tmp_path / "out")
    eot = GPT2Tokenizer().eot_token
    assert sum(int((ids == eot).sum()) for ids in tokens.values()) == len(documents)  # the separators only


def test_char_tokenizer_concatenates_documents_without_a_separator(tmp_path):
    meta = prepare_local(write_corpus(tmp_path / "corpus", "parquet"), tmp_path / "out", tokenizer="char")
    assert meta["chars"] == "".join(sorted(set("".join(DOCUMENTS)))) and meta["separator"] is None
    dataset, tokens = read_splits(tmp_path / "out")
    tokenizer = tokenizer_from_meta(dataset.meta)
    assert tokenizer.decode(tokens["val"].tolist()) == "".join(
        text for i, text in enumerate(DOCUMENTS) if in_val(i, prepare_module.SEED, 0.25)
    )


def test_single_text_file_is_cut_by_characters(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(CORPUS[:50_000], encoding="utf-8")
    meta = prepare_local(path, tmp_path / "out", val_fraction=0.2)
    assert meta["split_by"] == "characters" and meta["separator"] is None
    _, tokens = read_splits(tmp_path / "out")
    encoding = GPT2Tokenizer().encoding
    assert tokens["train"].tolist() == encoding.encode_ordinary(CORPUS[:40_000])
    assert tokens["val"].tolist() == encoding.encode_ordinary(CORPUS[40_000:50_000])


def test_bpe_trained_on_the_train_split_ships_with_the_data_and_decodes_it_back(tmp_path):
    meta = prepare_local(write_corpus(tmp_path / "corpus", "jsonl"), tmp_path / "out", tokenizer="bpe", vocab_size=400)
    assert meta["tokenizer"] == "json" and meta["vocab_size"] == 400 and meta["separator"] == END_OF_TEXT
    dataset, tokens = read_splits(tmp_path / "out")
    tokenizer = tokenizer_from_meta(dataset.meta)
    assert tokenizer.sha256 == meta["tokenizer_sha256"] and tokenizer.eot_token == 0
    for split, is_val in (("train", False), ("val", True)):
        expected = [text for i, text in enumerate(DOCUMENTS) if in_val(i, prepare_module.SEED, 0.25) == is_val]
        assert tokenizer.decode(tokens[split].tolist()).split(END_OF_TEXT)[:-1] == expected
    # the val documents are not what the tokenizer learnt from: it is the one trained on train alone
    train = [text for i, text in enumerate(DOCUMENTS) if not in_val(i, prepare_module.SEED, 0.25)]
    assert train_bpe(train, 400, progress=False).to_json() == (tmp_path / "out" / "tokenizer.json").read_text()


def test_a_given_tokenizer_json_prepares_the_same_ids(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", "jsonl")
    prepare_local(corpus, tmp_path / "trained", tokenizer="bpe", vocab_size=300)
    given = tmp_path / "given.json"
    given.write_bytes((tmp_path / "trained" / "tokenizer.json").read_bytes())
    prepare_local(corpus, tmp_path / "reused", tokenizer=str(given))
    for name in ("train.bin", "val.bin", "meta.json", "tokenizer.json"):
        assert (tmp_path / "reused" / name).read_bytes() == (tmp_path / "trained" / name).read_bytes()


def test_failed_bpe_preparation_leaves_no_tokenizer_behind(tmp_path):
    with pytest.raises(UserError, match=r"fewer than --block-size \+ 1 = 50,001"):
        prepare_local(write_corpus(tmp_path / "corpus", "jsonl"), tmp_path / "out", tokenizer="bpe", vocab_size=300,
                      block_size=50_000)  # fmt: skip
    assert_nothing_written(tmp_path / "out")


def test_a_dataset_whose_tokenizer_json_changed_is_refused(tmp_path):
    prepare_local(write_corpus(tmp_path / "corpus", "jsonl"), tmp_path / "out", tokenizer="bpe", vocab_size=300)
    path = tmp_path / "out" / "tokenizer.json"
    path.write_text(path.read_text().replace('"<|endoftext|>"', '"<|end|>"'))
    with pytest.raises(UserError, match=r"the tokenizer.json is not the one the dataset was tokenized with"):
        TokenDataset(tmp_path / "out")
    path.unlink()
    with pytest.raises(UserError, match=r"tokenizer.json is missing, and the dataset's token ids mean nothing"):
        TokenDataset(tmp_path / "out")


def assert_nothing_written(out):
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_empty_file_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(UserError, match=r"empty.txt is empty: there is nothing to train on"):
        prepare_local(tmp_path / "empty.txt", tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_bpe_on_a_corpus_of_empty_documents_is_refused(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    with pytest.raises(UserError, match=r"the corpus \(or its train split\) is empty: there is no text to train"):
        prepare_local(tmp_path / "c.jsonl", tmp_path / "out", tokenizer="bpe", vocab_size=300)
    assert_nothing_written(tmp_path / "out")


def test_jsonl_without_the_text_field_is_refused_with_its_fields(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"body": "a", "id": 1}\n{"body": "b", "id": 2}\n')
    with pytest.raises(UserError, match=r"c.jsonl has no 'text' field \(its fields: body, id\); .* --text-field"):
        prepare_local(tmp_path / "c.jsonl", tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_document_without_text_is_refused(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n{"text": null}\n')
    with pytest.raises(UserError, match=r"document 1 of .*c.jsonl has text=None, not text"):
        prepare_local(tmp_path / "c.jsonl", tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_non_utf8_file_is_refused_with_the_offset_of_the_bad_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "UTF8_CHECK_CHUNK", 4)  # the offset must survive chunk boundaries
    (tmp_path / "good.txt").write_text("first document", encoding="utf-8")
    # 'é' (c3 a9) straddles the first chunk boundary and is valid; e2 82 begins a 3-byte character
    # at byte 7, straddling the second boundary, but 'x' does not continue it
    (tmp_path / "broken.txt").write_bytes(b"caf\xc3\xa9ok\xe2\x82x caf")
    with pytest.raises(UserError, match=r"broken.txt is not UTF-8: byte 7 \(0xe2\) is invalid continuation byte"):
        prepare_local(tmp_path, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_corpus_smaller_than_the_context_leaves_no_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # a folder the user made: kept, but nothing is left in it
    with pytest.raises(UserError, match=r"the train split of .* tokens, fewer than --block-size \+ 1 = 50,001"):
        prepare_local(write_corpus(tmp_path / "corpus", "jsonl"), out, block_size=50_000)
    assert list(out.iterdir()) == []


def test_prepared_folder_is_never_overwritten(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", "jsonl")
    prepare_local(corpus, tmp_path / "out")
    with pytest.raises(UserError, match=r"out already holds a prepared dataset"):
        prepare_local(corpus, tmp_path / "out")


def test_file_names_with_glob_characters_are_read_as_written(tmp_path, monkeypatch):
    texts = {name: f"the text of {name}, " * 4 for name in ("book[1].txt", "book1.txt", "a*.txt", "a?.txt", "ab.txt")}
    folder = tmp_path / "g[x]"  # the folder's own name holds a pattern too
    folder.mkdir()
    for name, text in texts.items():
        (folder / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    for dataset, out in (("g[x]/book[1].txt", "one"), ("g[x]", "all")):
        args = ["--dataset", dataset, "--out", out, "--tokenizer", "gpt2", "--block-size", "4", "--val-fraction", "0.5"]
        assert run_entry_point("data/prepare.py", args, monkeypatch) == 0

    def documents(out):
        _, splits = read_splits(tmp_path / out)
        tokens = np.concatenate([splits["train"], splits["val"]])
        return GPT2Tokenizer().decode(tokens.tolist()).split(END_OF_TEXT)

    assert "".join(documents("one")) == texts["book[1].txt"]  # a single document, cut in two
    assert sorted(documents("all")) == sorted([*texts.values(), ""])  # each file once; "" after the last separator


def test_folder_of_mixed_file_kinds_is_refused(tmp_path):
    write_corpus(tmp_path / "corpus", "txt")
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "corpus" / "more.parquet")
    with pytest.raises(UserError, match=r"corpus mixes .parquet, .txt files"):
        open_corpus(str(tmp_path / "corpus"))


def test_folder_file_that_would_not_be_read_is_named_and_refused(tmp_path):
    """A folder's .TXT, .text or README is refused by name, as the same file alone is, never left out
    unseen; hidden files (.DS_Store, a .git folder) are skipped."""
    corpus = write_corpus(tmp_path / "corpus", "txt", DOCUMENTS[:3])
    (corpus / ".DS_Store").write_bytes(b"\x00")
    (corpus / ".git").mkdir()
    (corpus / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert len(local_files(corpus)) == 3
    (corpus / "Notes.TXT").write_text("loud text")
    (corpus / "more").mkdir()
    (corpus / "more" / "story.text").write_text("more text")
    with pytest.raises(
        UserError, match=r"2 file\(s\) in the folder would not be read: Notes.TXT, more/story.text \(only"
    ):
        local_files(corpus)
    with pytest.raises(UserError, match=r"Notes.TXT'?: .TXT is not one of .txt"):
        local_files(corpus / "Notes.TXT")


@pytest.mark.slow
def test_hub_name_offline_fails_at_once_with_advice(tmp_path):
    result = run_script("data/prepare.py", "--dataset", "roneneldan/TinyStories", "--tokenizer", "gpt2",
                        "--out", str(tmp_path / "out"))  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: --dataset='roneneldan/TinyStories' is not a local file or folder, and ")
    assert "this machine is offline" in result.stderr and "--dataset corpus.txt, corpus.jsonl" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert_nothing_written(tmp_path / "out")


@pytest.mark.slow
def test_unreachable_hub_fails_at_once_with_advice(tmp_path, monkeypatch):
    # not in datasets' offline mode: the hub (here a local port nobody listens on) is probed first
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    result = run_script("data/prepare.py", "--dataset", "roneneldan/TinyStories", "--tokenizer", "gpt2",
                        "--out", str(tmp_path / "out"))  # fmt: skip
    assert result.returncode == 2
    assert "the Hugging Face hub at http://127.0.0.1:9 cannot be reached" in result.stderr
    assert "this machine is offline. To prepare local data instead" in result.stderr
    assert_nothing_written(tmp_path / "out")


@pytest.mark.slow
def test_prepared_jsonl_trains_from_the_command_line(tmp_path):
    write_corpus(tmp_path / "corpus", "jsonl")
    result = run_script("data/prepare.py", "--dataset", "corpus/corpus.jsonl", "--tokenizer", "char",
                        "--data-dir", "prepared", "--block-size", "32", "--num-proc", "2", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote prepared/corpus:" in result.stdout and "from 40 documents" in result.stdout
    result = run_script("train.py", "--config", "configs/shakespeare_char.toml", "--data.dataset=corpus",
                        f"--data.data_dir={tmp_path / 'prepared'}", f"--train.out_dir={tmp_path / 'run'}",
                        "--model.block_size=32", "--train.max_iters=2", "--train.eval_iters=1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "bits per byte" in result.stdout + result.stderr
    evaluation = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"val_loss", "val_perplexity", "val_bpb"} <= evaluation.keys()
    assert np.isfinite(evaluation["val_bpb"])


def generated_documents(megabytes):
    """Documents made on the fly, so that nothing but the preparation holds them."""
    size = 0
    for i in itertools.count():
        text = f"{i}. {DOCUMENTS[i % len(DOCUMENTS)]}"  # a new string each time
        yield {"text": text}
        size += len(text)
        if size > megabytes * 1_000_000:
            return


def peak_memory_growth(out, sizes):
    """Prepare generated corpora of the given sizes one after the other; the peak resident KiB
    after each. Run in a fresh process, where the peak is this work's own."""
    import resource

    import datasets

    peaks = []
    for megabytes in sizes:
        stream = datasets.IterableDataset.from_generator(generated_documents, gen_kwargs={"megabytes": megabytes})
        corpus = Corpus("generated", stream, "text", None)
        prepare(corpus, "char", Path(out) / str(megabytes), num_proc=2, block_size=1)
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peaks


@pytest.mark.slow
def test_memory_stays_flat_whatever_the_corpus_size(tmp_path):
    code = f"from tests.test_prepare import peak_memory_growth; print(peak_memory_growth({str(tmp_path)!r}, [5, 40]))"
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    small, large = json.loads(result.stdout.splitlines()[-1])
    # holding the larger corpus's text or tokens would add 35 MB or more (KiB here; ru_maxrss is in KiB on Linux)
    assert large - small < 16_000, (small, large)


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_text_file_read_without_datasets_gives_the_text_datasets_reads(tmp_path, newline):
    """The bundled corpora are read without `datasets` (open_text_file) so that train.py prepares
    them where it is missing; what they give must be what open_corpus gives for the same file."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(newline.join(["First Citizen:", "Before we proceed, naïve 東京 🙂", ""]).encode("utf-8"))
    expected = [text for batch in open_corpus(str(path), streaming=True).text_batches(8) for text in batch]
    assert [text for batch in open_text_file(path).text_batches(8) for text in batch] == expected


def test_bundled_dataset_prepared_without_datasets_equals_the_datasets_path(tmp_path):
    prepare_module.prepare_bundled("shakespeare_char", tmp_path / "without")
    corpus = open_corpus(str(CORPUS_DIR / "tinyshakespeare.txt"), streaming=True)
    prepare(dataclasses.replace(corpus, name="tinyshakespeare.txt"), "char", tmp_path / "with" / "shakespeare_char")
    for name in ("train.bin", "val.bin", "meta.json"):
        without = (tmp_path / "without" / "shakespeare_char" / name).read_bytes()
        assert without == (tmp_path / "with" / "shakespeare_char" / name).read_bytes(), name


def test_a_tokenizer_json_that_cannot_encode_the_corpus_is_refused_naming_document_and_character(
    tmp_path, monkeypatch, capsys
):
    """Rather than a dataset that decodes to fewer characters than meta.json counts bytes of (the
    tokenizer.json of a character-level export has no unknown token). Not in the catalogue of bad
    inputs: the refusal comes while the progress bar is shown."""
    path = write_corpus(tmp_path / "corpus", "jsonl", [CORPUS[:3000], CORPUS[3000:6000] + " naïve"])
    (tmp_path / "tokenizer.json").write_text(CharTokenizer.from_text(CORPUS).to_json())
    lost = r"jsonl document 1: the text has characters that \S*tokenizer.json cannot encode: 'ï' at character 3,003 "
    with pytest.raises(UserError, match=lost):
        prepare_local(path, tmp_path / "out", tokenizer=str(tmp_path / "tokenizer.json"))
    assert_nothing_written(tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "single.txt").write_text("ROMEO: café\n" * 50)
    args = ["--dataset", "single.txt", "--tokenizer", "tokenizer.json", "--out", "out", "--block-size", "8"]
    assert run_entry_point("data/prepare.py", args, monkeypatch) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: single.txt: the text has characters that tokenizer.json cannot encode: 'é' at character 10 "
        "(it has no token for it and would drop it; use only text its vocabulary covers)"
    )
    assert_nothing_written(tmp_path / "out")
