"""A draft block holding its matrices as int8 rows (int8_rows.py, `PackedLinear.to_int8`): each
product is x times the scaled int8 rows (against float64, every row count and norm placement);
"auto" picks int8 by the block's bytes; a draft builds its int8 block once and keeps the format
through a cast (greedy output equal to AR's: test_draft_head's greedy test; the sampling
distribution: test_speculative's "int8+block" case)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax import model
from longspec_jax.draft_io import init_draft
from longspec_jax.errors import UserError
from longspec_jax.int8_rows import INT8_MIN_BYTES, block_reads_int8, quantized_rows
from longspec_jax.model import SCALE_AFTER_ROWS, Linear, PackedLinear, RMSNorm, inverse_rms
from longspec_jax.proposers import draft_parameters
from longspec_jax.target import random_target
from pallas_kernels.fused_linear import fused_linear
from tests.tiny_models import tiny_config

IN, OUTS = 48, (40, 24)


def _product(bias: bool, norm: bool, small_rows=()):
    rngs = nnx.Rngs(3)
    parts = [Linear(IN, n, bias=bias, dtype=jnp.float32, rngs=rngs) for n in OUTS]
    for p in parts:  # weights O(1), rows of very different sizes (each row gets its own scale)
        p.kernel[...] = jax.random.normal(rngs.params(), p.kernel.shape) * jnp.linspace(0.05, 3.0, p.kernel.shape[1])
        if bias:
            p.bias[...] = jax.random.normal(rngs.params(), p.bias.shape)
    rms = RMSNorm(IN, 1e-5, dtype=jnp.float32) if norm else None
    if norm:
        rms.weight[...] = 1.0 + 0.3 * jax.random.normal(rngs.params(), (IN,))
    return PackedLinear(parts, small_rows, rms)


@pytest.mark.parametrize("rows", [1, 2, 5, SCALE_AFTER_ROWS])
@pytest.mark.parametrize("bias,norm", [(False, False), (True, False), (False, True)])
def test_an_int8_product_is_x_times_the_scaled_int8_rows_against_float64(rows, bias, norm):
    """Rows 2 run as multiply-reduce (small_rows), 16 with a folded norm scale the output rows after."""
    product = _product(bias, norm, small_rows=(2,))
    weight = np.asarray(product.weight[...], np.float64)
    product.to_int8()
    q, scale = np.asarray(product.weight[...]), np.asarray(product.weight_scale[...], np.float64)
    assert q.dtype == np.int8 and q.shape == (sum(OUTS), IN) and scale.shape == (sum(OUTS),)
    assert (np.abs(q * scale[:, None] - weight) <= scale[:, None] / 2 * (1 + 1e-5)).all()
    x = 2.0 * jax.random.normal(jax.random.key(rows), (1, rows, IN))

    got = np.asarray(product(x), np.float64)

    x64 = np.asarray(x, np.float64)
    if norm:
        x64 = x64 * np.asarray(inverse_rms(x.astype(jnp.float32), 1e-5), np.float64)
    want = x64 @ (q * scale[:, None]).T
    if bias:
        want = want + np.asarray(product.bias[...], np.float64)
    assert got.shape == (1, rows, sum(OUTS))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    parts = product.parts(x)
    assert [p.shape[-1] for p in parts] == list(OUTS)


def test_converting_twice_keeps_the_first_rows():
    product = _product(False, False)
    product.to_int8()
    rows = product.weight[...]
    product.to_int8()
    assert product.weight[...] is rows


def test_auto_holds_a_large_block_as_int8_and_the_formats_override_it():
    assert block_reads_int8("auto", INT8_MIN_BYTES) and not block_reads_int8("auto", INT8_MIN_BYTES - 1)
    assert block_reads_int8("int8", 10) and not block_reads_int8("full", 10 * INT8_MIN_BYTES)
    with pytest.raises(UserError, match="choose one of auto, int8, full"):
        block_reads_int8("int4", 10)


def _block(draft, target, widths=()):
    """The block a proposer of `draft` runs (`draft_parameters`)."""
    graphdef, params = draft_parameters(draft, target, widths=widths)
    return nnx.merge(graphdef, params.block)


def test_a_draft_builds_its_int8_block_once_and_keeps_its_format():
    target = random_target(tiny_config(), seed=0, dtype="float32")
    draft = init_draft(target, seed=1)
    full = _block(draft, target)
    assert all(p.weight_scale is None and p.weight.dtype == jnp.float32 for p in full.products())  # a tiny block
    int8 = draft.with_block_format("int8")
    blocks = [_block(int8, target, widths=w) for w in ((2, 2), (4, 1))]
    for p, shared, unpacked in zip(blocks[0].products(), blocks[1].products(), full.products()):
        assert p.weight.dtype == jnp.int8 and p.weight_scale.dtype == jnp.float32
        assert shared.weight[...] is p.weight[...]  # built once, shared by every proposer
        np.testing.assert_array_equal(p.weight[...], quantized_rows(unpacked.weight[...])[0])
    assert blocks[0].input_layernorm.weight.dtype == jnp.float32  # norms stay as they are
    assert int8.cast(jnp.bfloat16).block_format == "int8" and draft.with_block_format("auto") is draft
    assert draft.proposal_key() == "all" and int8.with_head_format("int8").proposal_key() == "all/int8/block-int8"
    with pytest.raises(UserError, match="unknown draft block format 'int4'"):
        draft.with_block_format("int4")


def test_with_int8_products_on_the_kernel_a_gpu_runs_a_draft_levels_products_as_fused_linear(monkeypatch):
    """`int8_kernel_knobs`: only where INT8_PRODUCTS is "kernel" (XLA's GEMM by default), up to 64
    rows, on a GPU; the routed product (the kernel interpreted here) equals XLA's over the same rows."""
    monkeypatch.setattr(model.jax, "default_backend", lambda: "gpu")
    assert model.INT8_PRODUCTS == "xla" and model.int8_kernel_knobs(16, 4096) is None
    monkeypatch.setattr(model, "INT8_PRODUCTS", "kernel")
    assert model.int8_kernel_knobs(65, 4096) is None
    knobs = model.int8_kernel_knobs(16, 14336)
    assert knobs == model.int8_kernel_settings(14336) and 14336 % knobs["block_k"] == 0
    product = _product(True, False)
    product.to_int8()
    x = jax.random.normal(jax.random.key(0), (2, 8, IN))
    calls = []
    monkeypatch.setattr(
        model, "fused_linear", lambda *a, **kw: calls.append(kw) or fused_linear(*a, **kw, interpret=True)
    )

    routed = product(x)

    assert len(calls) == 1 and calls[0]["weight_scale"] is not None
    monkeypatch.setattr(model.jax, "default_backend", lambda: "cpu")
    assert model.int8_kernel_knobs(16, 4096) is None
    np.testing.assert_allclose(np.asarray(routed), np.asarray(product(x)), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1  # XLA's product this time
