"""benchmarks/bench_data_pipeline.py runs end to end on a tiny target and a small jsonl corpus."""

import json
import re

from benchmarks import bench_data_pipeline
from tests.tiny_models import save_tiny_checkpoint, tiny_config


def test_prints_the_batches_per_second_of_the_trainers_iterator(tmp_path, capsys):
    target = save_tiny_checkpoint(
        tmp_path / "target", tiny_config(vocab_size=320, bos_token_id=257, eos_token_ids=(256,))
    )
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(50)))
    bench_data_pipeline.main(
        ["--data", str(data), "--target", str(target), "--seq-len", "32", "--batch", "4", "--batches", "5"]
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    tokens = int(line.split()[0])
    assert tokens > 50 * 40 * 5  # every document tokenised as UTF-8 bytes (the tiny target has no tokenizer)
    assert re.search(r"5 batches of 4 x 32: [0-9.]+ batches/s, [0-9]+ k tokens/s$", line)
