"""The broad corpus: licence filter, sources with provenance, dedupe and caps, the held-out split;
the target-text generator's resumption; the committed diverse eval set.

Fake distributions / packages in tmp folders, a character-level tokenizer, a tiny random target (CPU).
"""

from __future__ import annotations

import email.message
import gzip
import json
from pathlib import Path

import pytest

from infer import build_eval_sets
from longspec_jax.errors import UserError
from tests.test_corpus_and_eval_sets import CharTokenizer, fake_code, fake_doc
from train import target_text
from train.build_corpus import build_corpus, cap_shares, share_cap
from train.corpus_documents import Document, Source, html_to_text, looks_generated, read_split, split_of
from train.corpus_licenses import distribution_license, spdx_permissive
from train.corpus_sources import NodePackages, PythonPackages

REPO = Path(__file__).resolve().parents[1]
DIVERSE = REPO / "infer" / "eval_sets" / "smollm2_diverse"


def metadata(license_field=None, expression=None, classifiers=()):
    m = email.message.Message()
    m["Name"] = "pkg"
    if license_field is not None:
        m["License"] = license_field
    if expression is not None:
        m["License-Expression"] = expression
    for c in classifiers:
        m["Classifier"] = c
    return m


@pytest.mark.parametrize(
    "meta, kept",
    [
        (metadata(expression="MIT"), True),
        (metadata(expression="BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0"), True),
        (metadata(expression="MIT OR GPL-2.0-only"), True),
        (metadata(expression="(Apache-2.0 OR BSD-2-Clause)"), True),
        (metadata(expression="MIT AND GPL-3.0-or-later"), False),
        (metadata(expression="MPL-2.0 AND MIT"), False),
        (metadata(expression="LicenseRef-NVIDIA-Proprietary"), False),
        (metadata("Apache 2.0", classifiers=["License :: OSI Approved :: Apache Software License"]), True),
        (metadata(classifiers=["License :: OSI Approved :: MIT License", "License :: OSI Approved"]), True),
        (metadata("BSD-3-Clause"), True),
        (metadata("ISC License"), True),
        (metadata("Apache 2.0", classifiers=["License :: Other/Proprietary License"]), False),
        (metadata("GPLv3"), False),
        (metadata(classifiers=["License :: OSI Approved :: GNU Lesser General Public License v3 (LGPLv3)"]), False),
        (metadata("Some Custom License"), False),
        (metadata(), False),
        (metadata("UNKNOWN"), False),
        (metadata("Copyright (c) 2001\n\nThis program is free software; see the GNU General Public License"), False),
        (
            metadata("Copyright (c) 2001\nRedistribution ...", classifiers=["License :: OSI Approved :: BSD License"]),
            True,
        ),
    ],
)
def test_licence_filter_keeps_permissive_only(meta, kept):
    label, reason = distribution_license(meta)
    assert (label is not None) == kept, reason
    assert reason


def test_spdx_expressions():
    assert spdx_permissive("Apache-2.0 WITH LLVM-exception")
    assert not spdx_permissive("")
    assert not spdx_permissive("GPL-2.0-or-later OR LGPL-2.1")


def write_dist(site: Path, name: str, license_expression: str, files: dict[str, str], description: str = "") -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    meta = (
        f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0\nLicense-Expression: {license_expression}\n\n{description}"
    )
    (info / "METADATA").write_text(meta)
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in [*files, f"{info.name}/METADATA"]))


def test_python_packages_read_only_permissive_distributions(tmp_path):
    site = tmp_path / "site"
    long_readme = "This package does useful things. " * 20
    write_dist(
        site,
        "goodpkg",
        "MIT",
        {
            "goodpkg/core.py": fake_code(1, 5),
            "goodpkg/ext.c": "int f(void) { return 1; }\n",
            "goodpkg/README.md": "# goodpkg\n\nIt works.\n",
            "goodpkg/LICENSE.md": "MIT licence text\n",
            "goodpkg/min.js": "x" * 5000,
        },
        long_readme,
    )
    write_dist(site, "badpkg", "GPL-3.0-only", {"badpkg/core.py": fake_code(2, 5), "badpkg/README.md": "# bad\n"})
    code = PythonPackages("pp-code", "code", 10, (str(site),))
    prose = PythonPackages("pp-prose", "doc", 20, (str(site),))
    skipped: list[str] = []
    code_docs, prose_docs = list(code.documents(skipped)), list(prose.documents(skipped))
    assert {d.path: d.domain for d in code_docs} == {
        "goodpkg/goodpkg/core.py": "code/python",
        "goodpkg/goodpkg/ext.c": "code/c-cpp",
    }
    assert {d.path: d.domain for d in prose_docs} == {
        "goodpkg/DESCRIPTION": "prose/readme",
        "goodpkg/goodpkg/README.md": "prose/readme",
    }
    assert all(d.license == "MIT" and d.group == "goodpkg" for d in code_docs + prose_docs)
    assert code.kept == {"goodpkg": "MIT"} and "GPL-3.0-only" in code.left_out["badpkg"]
    assert skipped == ["pp-code/goodpkg/goodpkg/min.js"]  # a minified file is read, then left out
    assert looks_generated("x" * 5000) and not looks_generated(fake_code(1, 5))


def test_node_packages_take_the_licence_of_their_package_json(tmp_path):
    for name, lic in (("good", "MIT"), ("bad", "GPL-2.0"), ("none", None)):
        (tmp_path / name / "lib").mkdir(parents=True)
        (tmp_path / name / "package.json").write_text(json.dumps({"name": name, "license": lic}))
        (tmp_path / name / "lib" / "index.js").write_text("module.exports = function () { return 1; };\n")
        (tmp_path / name / "lib" / "index.min.js").write_text("module.exports=1;\n")
    source = NodePackages("node", tmp_path, 10)
    docs = list(source.documents())
    assert [(d.path, d.license, d.domain) for d in docs] == [("good/lib/index.js", "MIT", "code/javascript")]
    assert set(source.left_out) == {"bad", "none"}


def test_html_pages_become_paragraphs():
    page = "<html><head><title>t</title><style>p{}</style></head><body><h1>Title</h1><p>One &amp; two.</p>"
    page += "<script>var x;</script><p>Three</p></body></html>"
    assert html_to_text(page) == "Title\n\nOne & two.\n\nThree\n"


def test_share_cap_bounds_every_key():
    sizes = {"big": 1000, "mid": 100, "small": 10, "tiny": 5}
    cap = share_cap(sizes, 0.4)
    capped = {k: min(v, cap) for k, v in sizes.items()}
    assert max(capped.values()) <= 0.4 * sum(capped.values()) + 1e-6
    assert cap == pytest.approx(30.0)  # c = 0.4 * (c + c + 10 + 5): both large sources are capped
    assert share_cap(sizes, 0.2) == float("inf")  # 4 keys cannot each be <= 20 %
    assert share_cap({"a": 10, "b": 10}, 0.6) == float("inf")  # nothing to cap
    docs = [Document("big", "MIT", "code", f"{i}", "x" * 100) for i in range(10)] + [
        Document("small", "MIT", "code", f"{i}", "y" * 100) for i in range(3)
    ]
    kept = cap_shares(docs, lambda d: d.source, 0.6)
    big = sum(d.source == "big" for d in kept)
    assert big / len(kept) <= 0.6 and sum(d.source == "small" for d in kept) == 3


def broad_sources(tmp_path: Path) -> list:
    code, docs = tmp_path / "code", tmp_path / "docs"
    code.mkdir()
    docs.mkdir()
    for i in range(40):
        (code / f"m{i:02d}.rs").write_text(fake_code(i, 4))
        (code / f"s{i:02d}.go").write_text(fake_code(100 + i, 4))
    (code / "copy_a.rs").write_text("fn same() {}\n")
    (code / "copy_b.rs").write_text("fn same() {}\n")
    for i in range(10):
        (docs / f"page{i}.md").write_text(fake_doc(i, 5))
    return [
        Source(
            "fake-code", code, "**/*.rs", "MIT OR Apache-2.0", "code", 20, domain="code", extra_patterns=("**/*.go",)
        ),
        Source("fake-books", docs, "**/*.md", "MIT", "doc", 30, domain="prose/book"),
    ]


def test_broad_corpus_provenance_split_dedupe_and_gzip(tmp_path):
    sources = broad_sources(tmp_path)
    manifest = build_corpus(tmp_path / "a", sources, dedupe=True, gz=True, source_share=0.9, shard_mb=0.002)
    build_corpus(tmp_path / "b", sources, dedupe=True, gz=True, source_share=0.9, shard_mb=0.002)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.gz"))
    assert len(files) > 2 and all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)

    train, held_out = read_split(tmp_path / "a" / "train"), read_split(tmp_path / "a" / "eval")
    raw = [json.loads(line) for line in gzip.open(tmp_path / "a" / files[0], "rt")]
    assert all(set(r) == {"text", "source", "license", "path", "domain"} and all(r.values()) for r in raw)
    assert {d.domain for d in train} == {"code/rust", "code/go", "prose/book"}
    assert not {d.key for d in train} & {d.key for d in held_out}
    percent = {"fake-code": 20, "fake-books": 30}
    assert all(split_of(d.key, percent[d.source]) == "eval" for d in held_out)
    assert all(split_of(d.key, percent[d.source]) == "train" for d in train)
    texts = [d.text for d in train]
    assert len(texts) == len(set(texts))  # the two copies became one (or were held out)
    assert not set(texts) & {d.text for d in held_out}
    copies = {"fake-code/copy_a.rs", "fake-code/copy_b.rs"}
    assert len(copies & {d.key for d in train}) <= 1
    assert (copies - {d.key for d in held_out}) - {d.key for d in train} <= set(manifest["duplicates_dropped"])
    assert manifest["train"]["by_domain"]["code/go"]["documents"] == sum(d.domain == "code/go" for d in train)


# ----------------------------------------------------------------------------- target text


def test_target_text_resumes_without_duplicating_ids(tmp_path):
    from tests.tiny_models import save_tiny_checkpoint, tiny_config
    from train.build_corpus import write_shards

    docs = [Document("src", "MIT", "code", f"f{i}.py", fake_code(i, 20), "code/python") for i in range(5)]
    write_shards(docs, tmp_path / "corpus", "train", 10**6)
    target = save_tiny_checkpoint(tmp_path / "target", tiny_config())
    out = tmp_path / "text.jsonl"
    common = ["--corpus", str(tmp_path / "corpus"), "--out", str(out), "--target", str(target), "--batch", "3"]
    common += ["--max-new-tokens", "4", "--prompt-tokens", "30,40"]

    assert target_text.main([*common, "--max-docs", "3"]) == 0
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert target_text.main([*common, "--max-docs", "5"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[:3] == first and len(records) == 5
    assert len({r["id"] for r in records}) == 5
    assert {r["task"] for r in records} == set(target_text.TASKS)
    for r in records:
        assert {"source", "path", "license", "seed", "temperature", "prompt", "response", "target"} <= set(r)
        assert r["id"] == f"{r['task']}:{r['source']}/{r['path']}" and r["license"] == "MIT"
        assert (
            1 <= r["response_tokens"] <= 4
            and 30 <= r["prompt_tokens"]
            and r["temperature"] == (0.0 if r["task"] == "greedy" else 0.8)
        )
    assert target_text.main([*common, "--max-docs", "5"]) == 0
    assert len(out.read_text().splitlines()) == 5  # nothing left to do
    assert target_text.main([*common[:-2], "--prompt-tokens", "30", "--max-docs", "1"]) == 2
    fixed = tmp_path / "fixed.jsonl"
    args = [*common[:3], str(fixed), *common[4:-2], "--prompt-lengths", "30,36", "--max-docs", "5"]
    assert target_text.main(args) == 0
    continued = [json.loads(line) for line in fixed.read_text().splitlines()]
    continued = [r for r in continued if r["task"] in target_text.CONTINUATIONS]
    assert continued and {r["prompt_tokens"] for r in continued} <= {30, 36}
    assert target_text.main([*args[:-2], "--prompt-lengths", "30,x"]) == 2


def test_target_text_passes_give_each_document_more_tasks():
    docs = [Document("src", "MIT", "doc", f"d{i}", fake_doc(i, 200), "prose/book") for i in range(4)]
    codec = target_text.ByteCodec(128)
    tasks = list(target_text.TASKS)

    def jobs(passes):
        return list(target_text.make_jobs(docs, tasks, codec, (20, 30), seed=0, passes=passes))

    one, seven = jobs(1), jobs(7)
    assert seven[: len(one)] == one  # the first pass does not depend on --passes
    assert len({j["id"] for j in seven}) == len(seven) == 7 * len(docs)
    for doc in docs:
        mine = [j for j in seven if j["path"] == doc.path]
        assert {j["task"] for j in mine[: len(tasks)]} == set(tasks)  # five passes: five tasks
        assert sum(j["id"].startswith(mine[0]["task"]) for j in mine) == 2  # the sixth pass repeats the first task
    later = [j for j in seven[len(one) :] if j["task"] in target_text.CONTINUATIONS]
    assert later and any(j["prompt"] != d.text[: len(j["prompt"])] for j in later for d in docs if d.path == j["path"])
    for j in later:  # a later pass starts at a line start inside its document
        text = next(d.text for d in docs if d.path == j["path"])
        at = text.find(j["prompt"])
        assert at >= 0 and (at == 0 or text[at - 1] == "\n")


def test_target_text_prompt_lengths_give_few_prompt_shapes_and_leave_short_documents_out():
    docs = [Document("src", "MIT", "doc", f"d{i}", fake_doc(i, 200), "prose/book") for i in range(6)]
    short = Document("src", "MIT", "doc", "tiny", "one short line\n", "prose/book")
    codec = target_text.ByteCodec(128)
    tasks = list(target_text.TASKS)
    jobs = list(target_text.make_jobs([*docs, short], tasks, codec, (20, 30), 0, passes=5, prompt_lengths=(24, 48)))
    assert jobs and all(j["path"] != "tiny" for j in jobs)
    continuations = [j for j in jobs if j["task"] in target_text.CONTINUATIONS]
    assert {len(j["prompt_ids"]) for j in continuations} == {24, 48}
    instructions = {task: len(text) for task, text in target_text.INSTRUCTIONS.items()}
    for j in jobs:
        if j["task"] not in target_text.CONTINUATIONS:  # excerpt, a blank line, the instruction
            assert len(j["prompt_ids"]) - 2 - instructions[j["task"]] <= 48
    # A range draws many lengths; the same documents and tasks with it give more prompt shapes.
    ranged = list(target_text.make_jobs(docs, tasks, codec, (20, 60), 0, passes=5))
    assert len({len(j["prompt_ids"]) for j in ranged}) > len({len(j["prompt_ids"]) for j in jobs})


def test_target_text_rejects_prompt_lengths_that_do_not_fit(tmp_path):
    class Generator:
        class target:
            class config:
                max_position_embeddings = 512

    with pytest.raises(UserError, match="--prompt-lengths"):
        target_text.generate_target_text(
            Generator(), target_text.ByteCodec(128), [], tmp_path / "t.jsonl", prompt_lengths=(256, 1024)
        )


def test_target_text_stops_at_the_time_limit(tmp_path):
    class SlowGenerator:
        class target:
            class config:
                max_position_embeddings = 512

        calls = 0

        def generate(self, prompts, **kwargs):
            import time

            SlowGenerator.calls += 1
            time.sleep(0.2)
            return type("R", (), {"tokens": [[5, 6] for _ in prompts]})()

    docs = [Document("src", "MIT", "doc", f"d{i}", fake_doc(i, 30), "prose/book") for i in range(8)]
    codec = target_text.ByteCodec(128)
    summary = target_text.generate_target_text(
        SlowGenerator(),
        codec,
        docs,
        tmp_path / "t.jsonl",
        tasks=("sample",),
        batch=1,
        max_new_tokens=2,
        prompt_tokens=(20, 30),
        time_limit_s=0.5,
        log=lambda m: None,
    )
    assert summary["stopped"] and 1 <= summary["written"] < 8 and summary["written"] == SlowGenerator.calls


class FakeGenerator:
    """A stand-in for `Generator` in the target-text tests: records each call's rows and settings and
    answers each row with `reply(row)`'s tokens."""

    class target:
        class config:
            max_position_embeddings = 512

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def generate(self, prompts, **kwargs):
        self.calls.append({"rows": len(prompts), **kwargs})
        return type("R", (), {"tokens": [self.reply(i) for i in range(len(prompts))]})()


def target_text_of(tmp_path, generator, documents: int, **settings) -> tuple[dict, list[dict]]:
    """(summary, records) of `generate_target_text` over `documents` prose documents."""
    docs = [Document("src", "MIT", "doc", f"d{i}", fake_doc(i, 30), "prose/book") for i in range(documents)]
    out = tmp_path / "t.jsonl"
    summary = target_text.generate_target_text(
        generator,
        target_text.ByteCodec(128),
        docs,
        out,
        max_new_tokens=2,
        prompt_tokens=(20, 30),
        log=lambda m: None,
        **settings,
    )
    return summary, [json.loads(line) for line in out.read_text().splitlines()]


def test_target_text_calls_are_always_whole_batches(tmp_path):
    generator = FakeGenerator(lambda i: [7] * (i + 1))
    summary, records = target_text_of(tmp_path, generator, 7, tasks=("sample", "greedy"), batch=3)
    sizes = [call["rows"] for call in generator.calls]
    assert summary["written"] == len(records) == 7 and len({r["id"] for r in records}) == 7
    assert set(sizes) == {3}  # 3 greedy + 4 sampled jobs: short batches padded to 3 rows
    assert max(r["response_tokens"] for r in records) <= 3  # padding rows' outputs are not written
    assert target_text.full_batch([[1], [2]], 4) == [[1], [2], [2], [2]]


def test_target_text_at_temperature_zero_answers_every_task_greedily_once(tmp_path):
    """--temperature 0 makes every task greedy (the instructions' answers too, as a greedy eval
    decodes them): each job is generated once, at T = 0."""
    generator = FakeGenerator(lambda i: [7, 8])
    summary, records = target_text_of(
        tmp_path, generator, 6, tasks=("summarise", "greedy", "sample"), batch=2, temperature=0.0
    )
    temperatures = [call["temperature"] for call in generator.calls]
    assert summary["written"] == len(records) == 6 and len({r["id"] for r in records}) == 6
    assert {r["task"] for r in records} == {"summarise", "greedy", "sample"}
    assert {r["temperature"] for r in records} == {0.0} and set(temperatures) == {0.0}


def test_target_text_rejects_a_negative_temperature_before_any_batch(tmp_path):
    generator = FakeGenerator(lambda i: [7])
    with pytest.raises(UserError, match="--temperature -0.5"):
        target_text_of(tmp_path, generator, 4, tasks=("greedy", "summarise"), batch=2, temperature=-0.5)
    assert generator.calls == []  # the greedy jobs did not run first


# ----------------------------------------------------------------------------- diverse eval set


def test_diverse_sets_cover_domains_and_use_held_out_documents():
    def docs(domain, kind, count, make, size):
        return [
            Document(f"src-{domain.split('/')[1]}", "MIT", kind, f"d{i}", make(i, size), domain) for i in range(count)
        ]

    held_out = []
    for dom in ("code/python", "code/rust", "code/go"):
        held_out += docs(dom, "code", 5, fake_code, 20)
    for dom in ("prose/readme", "prose/book", "prose/manual"):
        held_out += docs(dom, "doc", 5, fake_doc, 14)
    spec = build_eval_sets.DiverseSpec(
        length_range=(150, 400), buckets={"s": (60, 120)}, code_per_domain=2, prose_per_domain=2, per_bucket=3
    )
    sets, info = build_eval_sets.build_diverse_sets(held_out, CharTokenizer(), spec)
    assert info["domains"] == ["code/python", "code/rust", "code/go", "prose/book", "prose/manual", "prose/readme"]
    assert set(info["left_out"]) == {"code/c-cpp", "code/javascript", "code/shell", "prose/reference", "prose/docs"}
    keys = {d.key: d for d in held_out}
    for task, items in sets.items():
        for item in items:
            doc = keys[item["source_path"]]
            assert item["domain"] == doc.domain and item["id"].startswith(f"{task}-{doc.domain.split('/')[1]}")
            assert doc.text.startswith(item["text"].removesuffix(build_eval_sets.SUMMARY_INSTRUCTION).rstrip())
    assert len(sets["code_completion"]) == 6 and len(sets["summarisation"]) == 6 and len(sets["prefill_length"]) == 3
    assert len({i["domain"] for i in sets["prefill_length"]}) == 3
    with pytest.raises(UserError, match="3 languages"):
        build_eval_sets.build_diverse_sets([d for d in held_out if d.domain != "code/go"], CharTokenizer(), spec)


def test_committed_diverse_set_is_well_formed_and_held_out():
    manifest = json.loads((DIVERSE / "manifest.json").read_text())
    assert manifest["vocab_size"] == 49152
    langs = {d for d in manifest["domains"] if d.startswith("code/")}
    kinds = {d for d in manifest["domains"] if d.startswith("prose/")}
    assert len(langs) >= 3 and len(kinds) >= 3
    ids = set()
    for task in ("code_completion", "summarisation", "prefill_length"):
        items = read_jsonl_file(DIVERSE / f"{task}.jsonl")
        assert len(items) == manifest["tasks"][task]["prompts"] > 0
        for item in items:
            assert item["id"] not in ids
            ids.add(item["id"])
            assert item["prompt_len"] == len(item["prompt_ids"]) and all(0 <= t < 49152 for t in item["prompt_ids"])
            source = item["source_path"].split("/", 1)[0]
            assert split_of(item["source_path"], manifest["eval_percent"][source]) == "eval"
            assert source not in ("python-stdlib", "python-docs")
            if task != "prefill_length":
                assert 2048 <= item["prompt_len"] <= 7168
            assert item["chat"] == (task == "summarisation")


def read_jsonl_file(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
