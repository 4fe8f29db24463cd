"""benchmarks/bench_speculative.py's draft floor: what a round's draft steps must read."""

import jax.numpy as jnp

from benchmarks.bench_speculative import SHAPES, draft_round_bytes
from longspec_jax.draft_io import init_draft
from longspec_jax.target import random_target


def test_draft_floor_reads_block_head_and_last_layer_cache_each_step():
    target = random_target(SHAPES["tiny"], dtype="float32")
    model, draft = target.decode_model(), init_draft(target, seed=1)
    one = draft_round_bytes(model, draft, context=64, batch=1, depth=1)
    assert draft_round_bytes(model, draft, context=64, batch=1, depth=5) == 5 * one
    c = model.config
    per_row = 2 * c.num_kv_heads * c.head_dim * jnp.dtype(model.dtype).itemsize
    assert draft_round_bytes(model, draft, context=96, batch=1, depth=1) - one == 32 * per_row
    assert draft_round_bytes(model, draft, context=64, batch=2, depth=1) - one == 64 * per_row
    head = c.vocab_size * c.hidden_size * 4
    assert one > head + 64 * per_row  # and the block's weights


def test_a_cut_draft_reads_only_its_candidates_rows_of_the_head():
    from benchmarks.decode_kernels import with_vocabulary as with_candidates

    target = random_target(SHAPES["tiny"], dtype="float32")
    model, draft = target.decode_model(), init_draft(target, seed=1)
    c = model.config
    whole = draft_round_bytes(model, with_candidates(draft, "all"), context=64, batch=1, depth=2)
    cut = draft_round_bytes(model, with_candidates(draft, "32"), context=64, batch=1, depth=2)
    assert whole - cut == 2 * (c.vocab_size - 32) * c.hidden_size * 4
    assert with_candidates(draft, "32").candidate_tokens.tolist() == list(range(32))


def test_the_round_with_a_lookup_chain_is_timed_on_its_combined_tree(capsys):
    """--lookup-tokens times the tree with the chain beside it: the table says which tree ran."""
    from benchmarks import bench_speculative

    bench_speculative.main(
        [
            "--small",
            "--contexts",
            "64",
            "--rounds",
            "2",
            "--repeats",
            "1",
            "--tree-widths",
            "2,2",
            "--lookup-tokens",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert "tree (2, 2) with a prompt-lookup chain of 3 tokens" in out
    row = next(line for line in out.splitlines() if line.startswith("tiny "))
    assert float(row.split()[3]) > 0  # round ms
