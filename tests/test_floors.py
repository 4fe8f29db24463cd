"""benchmarks/floors.py: a step's floor is the longer of its bytes at the memory rate and its FLOPs at
the matmul rate, for the products and the attention each; a draft level's likewise."""

import dataclasses
import math

import jax
import pytest
from flax import nnx

from benchmarks import floors
from benchmarks.bench_speculative import SHAPES
from benchmarks.decode_kernels import with_vocabulary
from longspec_jax.draft_io import init_draft
from longspec_jax.target import random_target

BYTES = floors.Rates(bandwidth=1.0, matmul=math.inf)  # a floor in bytes
FLOPS = floors.Rates(bandwidth=math.inf, matmul=1.0)  # a floor in FLOPs


def _model(tied: bool):
    config = dataclasses.replace(SHAPES["tiny"], tie_word_embeddings=tied)
    return random_target(config, dtype="float32").decode_model()


@pytest.mark.parametrize("tied", [False, True])
def test_products_read_every_weight_but_an_untied_embedding(tied):
    model = _model(tied)
    c = model.config
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    table = c.vocab_size * c.hidden_size
    assert floors.product_weights(model) == (total if tied else total - table)


def test_a_step_in_bytes_reads_the_weights_and_the_cache_once():
    model = _model(False)
    c = model.config
    weights = floors.product_weights(model) * 4
    kv = 2 * c.num_layers * 3 * 100 * c.num_kv_heads * c.head_dim * 4  # batch 3, 100 rows each
    assert floors.step_seconds(model, 1, 100, 3, BYTES) == weights + kv
    assert floors.step_seconds(model, 64, 100, 3, BYTES) == weights + kv  # more rows, the same bytes


def test_a_step_in_flops_grows_with_its_rows_and_its_context():
    model = _model(False)
    c = model.config
    products = 2 * 3 * 64 * floors.product_weights(model)
    attention = 4 * c.num_layers * 3 * 100 * 64 * c.num_heads * c.head_dim
    assert floors.step_seconds(model, 64, 100, 3, FLOPS) == products + attention


def test_each_part_takes_the_longer_of_its_two_floors():
    model = _model(False)
    c = model.config
    # At 40 FLOPs a byte the products (2 x 64 rows a weight / 4 bytes = 32 FLOPs a byte) are bound by
    # their bytes, the attention (4 x 64 x Hq x D per K/V row of 2 Hkv D x 4 bytes) by its FLOPs.
    rates = floors.Rates(bandwidth=1.0, matmul=40.0)
    products = floors.product_weights(model) * 4
    attention = 4 * c.num_layers * 100 * 64 * c.num_heads * c.head_dim / 40.0
    assert attention > 2 * c.num_layers * 100 * c.num_kv_heads * c.head_dim * 4  # FLOP-bound indeed
    assert floors.step_seconds(model, 64, 100, 1, rates) == pytest.approx(products + attention)


def test_a_draft_level_reads_its_block_the_head_and_the_last_layer_cache():
    target = random_target(SHAPES["tiny"], dtype="float32")
    model, draft = target.decode_model(), init_draft(target, seed=1)
    c = model.config
    one = floors.draft_level_seconds(model, draft, 4, 64, 1, BYTES)
    per_row = 2 * c.num_kv_heads * c.head_dim * 4
    assert floors.draft_level_seconds(model, draft, 4, 96, 1, BYTES) - one == 32 * per_row
    assert floors.draft_level_seconds(model, draft, 4, 64, 2, BYTES) - one == 64 * per_row
    assert one > c.vocab_size * c.hidden_size * 4 + 64 * per_row  # and the block's weights
    cut_draft = with_vocabulary(draft, "32")
    assert cut_draft.candidate_tokens.tolist() == list(range(32))
    cut = floors.draft_level_seconds(model, cut_draft, 4, 64, 1, BYTES)
    assert one - cut == (c.vocab_size - 32) * c.hidden_size * 4  # only its candidates' rows of the head
    int8 = floors.draft_level_seconds(model, draft.with_head_format("int8"), 4, 64, 1, BYTES)
    assert one - int8 == c.vocab_size * (c.hidden_size * 4 - (c.hidden_size + 4))  # a byte a weight, a scale a row
    block = floors.draft_level_seconds(model, draft.with_block_format("int8"), 4, 64, 1, BYTES)
    matrices = [x for x in jax.tree.leaves(nnx.state(draft.block)) if x.ndim == 2]
    assert len(matrices) == 9  # q, k, v, o, cross q and o, gate, up, down
    assert one - block == sum(m.size * 4 - (m.size + 4 * m.shape[1]) for m in matrices)  # norms and biases stay


def test_a_round_of_draft_levels_runs_the_root_then_each_level_but_the_last():
    target = random_target(SHAPES["tiny"], dtype="float32")
    model, draft = target.decode_model(), init_draft(target, seed=1)
    level = lambda rows: floors.draft_level_seconds(model, draft, rows, 64, 1, FLOPS)
    assert floors.draft_round_seconds(model, draft, (2, 5, 3), 64, 1, FLOPS) == level(1) + level(2) + level(5)
    assert floors.draft_round_seconds(model, draft, (2, 5, 3), 64, 1, BYTES) == 3 * floors.draft_level_seconds(
        model, draft, 1, 64, 1, BYTES
    )


def test_measured_rates_are_positive_on_this_device():
    rates = floors.measure_rates(small=True)
    assert 0 < rates.bandwidth < math.inf and 0 < rates.matmul < math.inf
