"""The data pipeline: local files through `datasets` and grain into packed, masked, seeded batches."""

import json
import re

import numpy as np
import pytest

from longspec_jax.config import ModelConfig
from longspec_jax.errors import UserError
from train.data import ByteEncoder, batch_iterator, find_files, load_corpus, text_encoder

MODEL = ModelConfig(
    model_type="llama",
    vocab_size=320,
    hidden_size=8,
    intermediate_size=8,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=8,
    bos_token_id=257,
    eos_token_ids=(256,),
)
BOS, EOS = 257, 256


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def corpus(tmp_path, paths, **kwargs):
    return load_corpus(
        [str(p) for p in paths], text_encoder(None, MODEL), MODEL, cache_dir=str(tmp_path / "cache"), **kwargs
    )


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_sft_records_train_on_the_response_only(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q?", "response": "Ans"}])
    c = corpus(tmp_path, [path])
    record = c.records[0]
    assert record["tokens"] == [BOS, *b"Q?", *b"Ans", EOS]
    assert record["loss_mask"] == [0, 0, 0, 1, 1, 1, 1]
    assert c.num_tokens == 7


def test_gzipped_jsonl_reads_like_plain_jsonl(tmp_path):
    import gzip

    records = [{"text": "alpha beta"}, {"text": "gamma"}]
    (tmp_path / "plain").mkdir()
    (tmp_path / "packed").mkdir()
    plain = write_jsonl(tmp_path / "plain" / "a.jsonl", records)
    packed = tmp_path / "packed"
    with gzip.open(packed / "a.jsonl.gz", "wt") as f:
        f.write(plain.read_text())
    assert [p.name for p in find_files([str(packed)])] == ["a.jsonl.gz"]
    assert corpus(tmp_path, [packed]).records[:] == corpus(tmp_path, [plain]).records[:]


def test_plain_text_trains_on_everything_after_bos(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "abc"}, {"body": ""}])
    c = corpus(tmp_path, [path], text_field="body")
    assert len(c.records) == 1  # the empty record is dropped
    assert c.records[0]["tokens"] == [BOS, *b"abc", EOS] and c.records[0]["loss_mask"] == [0, 1, 1, 1, 1]


def test_text_parquet_and_directories(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "doc.txt").write_text("line one\nline two\n")
    pq.write_table(pa.table({"text": ["pq record"]}), data / "part.parquet")
    (data / "notes.bin").write_bytes(b"ignored")
    files = find_files([str(data)])
    assert [f.name for f in files] == ["part.parquet", "doc.txt"]
    c = corpus(tmp_path, [data])
    texts = sorted(bytes(r["tokens"][1:-1]).decode() for r in c.records)
    assert texts == ["line one\nline two\n", "pq record"]  # a text file is one document


def test_records_without_known_fields_name_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"content": "a"}])
    with pytest.raises(UserError, match="text_field"):
        corpus(tmp_path, [path])


def test_missing_and_unknown_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        find_files([str(tmp_path / "nope")])
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(UserError, match="unknown format"):
        find_files([str(tmp_path / "x.csv")])
    with pytest.raises(UserError, match="no training data"):
        find_files([])


def test_no_tokenizer_needs_a_byte_sized_vocabulary():
    import dataclasses

    assert isinstance(text_encoder(None, MODEL), ByteEncoder) and text_encoder(None, MODEL).bos == [BOS]
    with pytest.raises(UserError, match="257"):
        text_encoder(None, dataclasses.replace(MODEL, vocab_size=100))


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """40 records of different lengths whose tokens say which record they came from."""
    tmp = tmp_path_factory.mktemp("numbered")
    records = [{"prompt": chr(65 + i % 26) * 2, "response": chr(97 + i % 26) * (3 + i % 7)} for i in range(40)]
    return corpus(tmp, [write_jsonl(tmp / "n.jsonl", records)])


def test_batches_are_packed_rows_of_the_token_stream(numbered):
    batches = take(batch_iterator(numbered, seq_len=16, batch_size=4, seed=0), 6)
    for b in batches:
        assert b["tokens"].shape == (4, 16) and b["loss_mask"].shape == (4, 16)
        assert b["tokens"].dtype == np.int32
    stream = np.concatenate([b["tokens"].reshape(-1) for b in batches])
    masks = np.concatenate([b["loss_mask"].reshape(-1) for b in batches])
    assert set(np.unique(masks)) == {0, 1}
    # Concatenated without padding (no token is 0), BOS never a label, EOS always one.
    assert np.all(stream != 0)
    assert np.all(masks[stream == BOS] == 0) and np.all(masks[stream == EOS] == 1)


def test_shuffle_is_seeded(numbered):
    a = take(batch_iterator(numbered, seq_len=16, batch_size=4, seed=1), 3)
    b = take(batch_iterator(numbered, seq_len=16, batch_size=4, seed=1), 3)
    c = take(batch_iterator(numbered, seq_len=16, batch_size=4, seed=2), 3)
    assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
    assert not all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))


def test_restored_state_continues_with_the_same_batches(numbered):
    it = batch_iterator(numbered, seq_len=16, batch_size=4, seed=3)
    take(it, 5)
    state = it.get_state()
    expected = take(it, 20)  # crosses into the next (reshuffled) epoch
    fresh = batch_iterator(numbered, seq_len=16, batch_size=4, seed=3)
    fresh.set_state(json.loads(json.dumps(state)))  # as stored in a checkpoint
    got = take(fresh, 20)
    for x, y in zip(expected, got):
        assert np.array_equal(x["tokens"], y["tokens"]) and np.array_equal(x["loss_mask"], y["loss_mask"])


def test_processes_read_disjoint_records(numbered):
    firsts = []
    for index in range(2):
        it = batch_iterator(numbered, seq_len=8, batch_size=1, seed=0, process_index=index, process_count=2)
        rows = np.concatenate([b["tokens"].reshape(-1) for b in take(it, 12)])
        firsts.append({int(t) for t in rows if 65 <= t < 91})  # prompt letters name the records
    assert firsts[0] and firsts[1] and not (firsts[0] & firsts[1])


def _word_tokenizer(adds_bos: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if adds_bos:  # as Llama tokenizers do; Qwen2 / SmolLM2 ones add nothing
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("adds_bos", [True, False])
def test_documents_start_as_the_target_tokenizer_starts_a_text(adds_bos):
    encoder = text_encoder(_word_tokenizer(adds_bos), MODEL)
    assert encoder.bos == ([0] if adds_bos else [])
    assert encoder.encode("hello world") == [3, 4]  # no special tokens inside a document


@pytest.mark.parametrize("adds_bos", [True, False])
def test_a_batch_encodes_as_its_texts_one_by_one(tmp_path, adds_bos):
    tokenizer = _word_tokenizer(adds_bos)
    encoder = text_encoder(tokenizer, MODEL)
    texts = ["hello world", "", "world world hello", "hello"]
    assert encoder.encode_batch(texts) == [[3, 4], [], [4, 4, 3], [3]]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": t, "response": "world"} for t in texts])
    records = load_corpus([str(path)], encoder, MODEL, cache_dir=str(tmp_path / "cache")).records
    bos = encoder.bos
    assert [r["tokens"] for r in records] == [bos + encoder.encode(t) + [4, 256] for t in texts]


def test_a_malformed_json_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "cut short\n{"text": "fine"}\n')
    with pytest.raises(UserError, match=f"^{path}:2: not valid JSON .*: fix or remove that record$"):
        corpus(tmp_path, [path])


def test_a_malformed_json_document_names_its_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"text": "a"},\n {"text": "b"\n]\n')
    with pytest.raises(UserError, match=f"^{path}:3: not valid JSON"):
        corpus(tmp_path, [path])


@pytest.mark.parametrize("value, shown", [(5, "5"), (["a", "b"], '["a", "b"]')])
def test_text_that_is_not_a_string_names_the_file_line_and_field(tmp_path, value, shown):
    good = write_jsonl(tmp_path / "good.jsonl", [{"body": "fine"}])
    bad = write_jsonl(tmp_path / "mixed.jsonl", [{"body": "fine"}, {"body": value}])
    with pytest.raises(
        UserError, match=f"^{bad}:2: field 'body' is {re.escape(shown)}, not a string.*--set text_field="
    ):
        corpus(tmp_path, [good, bad], text_field="body")


def test_a_response_that_is_not_a_string_names_its_setting(tmp_path):
    bad = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q", "response": 1}])
    with pytest.raises(UserError, match="field 'response' is 1, not a string.*--set response_field="):
        corpus(tmp_path, [bad])


def test_data_repeats_raise_a_sources_share(tmp_path):
    (tmp_path / "big").mkdir()
    write_jsonl(tmp_path / "big" / "a.jsonl", [{"text": "aaaa"}, {"text": "bbbb"}, {"text": "cccc"}])
    own = write_jsonl(tmp_path / "own.jsonl", [{"prompt": "Q", "response": "rr"}])
    once = corpus(tmp_path, [tmp_path / "big", own])
    thrice = corpus(tmp_path, [tmp_path / "big", own], repeats=(1, 3))
    assert len(once.records) == 4 and len(thrice.records) == 6
    sft = [r for r in thrice.records if r["tokens"] == [BOS, *b"Q", *b"rr", EOS]]
    assert len(sft) == 3 and all(r["loss_mask"] == [0, 0, 1, 1, 1] for r in sft)
    assert thrice.num_tokens == once.num_tokens + 2 * 5
    with pytest.raises(UserError, match="one per path"):
        corpus(tmp_path, [tmp_path / "big", own], repeats=(2,))


def test_data_repeats_are_checked_against_the_data_paths():
    from train.config import apply_overrides, load_config

    cfg = load_config("tiny")
    paths = len(cfg.current.data)
    good = apply_overrides(cfg, [f"data_repeats={','.join(['2'] * paths)}"]).validate()
    assert good.current.data_repeats == (2,) * paths
    with pytest.raises(UserError, match="one count >= 1 for each"):
        apply_overrides(cfg, [f"data_repeats={','.join(['1'] * (paths + 1))}"]).validate()
    with pytest.raises(UserError, match="one count >= 1 for each"):
        apply_overrides(cfg, [f"data_repeats={','.join(['0'] * paths)}"]).validate()
