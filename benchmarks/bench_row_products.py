"""A few rows times a 7B layer's weight matrices: XLA's products against the Mosaic GPU weight
streamer (`pallas_kernels.row_matmul_mgpu`), each beside the bytes floor of the same process.

    python -m benchmarks.bench_row_products [--shapes llama31_8b,vicuna7b] [--rows 1,16,64]
        [--layers 32] [--repeats 10] [--configs 128:1:4,256:1:4,...] [--int8] [--reduction]
        [--xla-splits 1,2,4] [--json OUT]

Each product (q|k|v, o, gate|up, down, in the inference layout [N, K]) runs over `--layers`
distinct weight matrices, one after the other, inside a device loop of `--repeats` passes: a real
model's layers, so no weight is found in the L2 from the pass before. Each product's output is
summed into a running number (one small reduction a product, the same for every variant) so that
nothing is skipped. The streamer's knobs are swept as tile_n:splits:stages at the largest row
count; the best one is then timed at every row count. Ratios are to the weights' bytes (and the
matrix work) at the rates `floors.measure_rates` measures in the same process. --int8 also times
each product over int8 copies of the same matrices with a float32 scale a row (a draft's block,
int8_rows.py): XLA's product, XLA's int8 by int8 product of the rows' two int8 parts
(`head_top_k.int8_parts`, stacked as one operand of twice the rows, so the weight is read once) and
`fused_linear` with the model's settings for it. --reduction also times each product as
`PackedLinear` writes its `SMALL_ROWS` (a multiply and a float32 sum over each weight row, one
reduction kernel) beside XLA's product, each with its output written out as the model's next
kernel reads it (here the loop's sum could otherwise absorb the product's last step): whether a
row count belongs in `SMALL_ROWS` at a shape. --xla-splits also times XLA's product with K cut into
each given number of slices, one batched product of float32 partials written out (what a consumer
that sums partials, as the norm kernels sum the streamer's, would read).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib

import jax
import jax.numpy as jnp

from benchmarks import floors
from longspec_jax import model
from longspec_jax.int8_rows import quantized_rows
from longspec_jax.model_shapes import MODEL_SHAPES
from pallas_kernels import row_matmul_mgpu
from pallas_kernels.fused_linear import fused_linear
from pallas_kernels.head_top_k import LOW_STEPS, int8_parts

DEFAULT_CONFIGS = "128:1:4,128:1:8,64:1:8,64:2:8,128:2:8,128:4:8,256:4:4,256:8:4"


def product_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each packed product of one layer of MODEL_SHAPES[name]."""
    c = MODEL_SHAPES[name]
    h, d = c.hidden_size, c.head_dim
    return {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * d, h),
        "o": (h, c.num_heads * d),
        "gate_up": (2 * c.intermediate_size, h),
        "down": (h, c.intermediate_size),
    }


def xla_product(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=x.dtype)


def reduced_product(x, w):
    """The product as `PackedLinear` writes its small rows (`model.multiply_reduce`)."""
    return model.multiply_reduce(x, w, x.dtype)


def written_out(product):
    """`product` with its output written to memory before anything reads it."""
    return lambda x, w: jax.lax.optimization_barrier(product(x, w))


def run_reduction(name, product, weights, rows_list, repeats, rates):
    """XLA's product and the multiply-reduce one (`reduced_product`), each written out."""
    n, k = weights[0].shape
    records = []
    for rows in rows_list:
        floor = rates.seconds(n * k * 2, 2 * rows * n * k)
        xla = time_product(written_out(xla_product), weights, rows, repeats)
        reduced = time_product(written_out(reduced_product), weights, rows, repeats)
        records.append(
            dict(shape=name, product=f"{product} written out", n=n, k=k, rows=rows, floor_us=1e6 * floor,
                 xla_us=1e6 * xla, reduction_us=1e6 * reduced)
        )  # fmt: skip
        print(
            f"{name:<11}{product:<8} rows {rows:>3}, written out: floor {1e6 * floor:7.1f} us | XLA {1e6 * xla:7.1f}"
            f" ({xla / floor:4.2f}x) | multiply-reduce {1e6 * reduced:7.1f} ({reduced / floor:4.2f}x)"
        )
    return records


def xla_split_product(splits: int):
    """XLA's product with K cut into `splits` slices, one batched product of float32 partials
    [splits, rows, N] written out (a consumer that sums them, as the norm kernels sum the streamer's)."""

    def product(x, w):
        rows, k = x.shape
        parts = jax.lax.dot_general(
            x.reshape(rows, splits, k // splits),
            w.reshape(w.shape[0], splits, k // splits),
            (((2,), (2,)), ((1,), (1,))),
            preferred_element_type=jnp.float32,
        )
        return jax.lax.optimization_barrier(parts)

    return product


def run_xla_splits(name, product, weights, rows_list, splits_list, repeats, rates):
    """XLA's product in K slices of float32 partials (`xla_split_product`) beside the plain one."""
    n, k = weights[0].shape
    records = []
    for rows in rows_list:
        floor = rates.seconds(n * k * 2, 2 * rows * n * k)
        times = {s: time_product(xla_split_product(s), weights, rows, repeats) for s in splits_list if k % s == 0}
        records.append(
            dict(shape=name, product=f"{product} XLA in K slices", n=n, k=k, rows=rows, floor_us=1e6 * floor,
                 split_us={s: 1e6 * t for s, t in times.items()})
        )  # fmt: skip
        shown = " | ".join(f"{s} slices {1e6 * t:7.1f} ({t / floor:4.2f}x)" for s, t in times.items())
        print(f"{name:<11}{product:<8} rows {rows:>3}, XLA in K slices: floor {1e6 * floor:7.1f} us | {shown}")
    return records


def streamed(tile_n: int, splits: int, stages: int):
    return lambda x, w: row_matmul_mgpu.row_matmul(x, w, tile_n=tile_n, splits=splits, stages=stages)


def fits(config: tuple[int, int, int], n: int, k: int) -> bool:
    tile_n, splits, _ = config
    return n % tile_n == 0 and k % (row_matmul_mgpu.TILE_K * splits) == 0


def time_product(product, weights, rows: int, repeats: int) -> float:
    """Seconds per product call, over len(weights) matrices and `repeats` passes."""

    @jax.jit
    def passes(weights, x, n):
        def body(_, carry):
            x, total = carry
            for w in weights:
                total = total + jnp.sum(product(x, w), dtype=jnp.float32)
            return x, total

        return jax.lax.fori_loop(0, n, body, (x, jnp.float32(0)))

    x = jax.random.normal(jax.random.key(1), (rows, jax.tree.leaves(weights)[0].shape[1]), jnp.bfloat16)
    n = jnp.asarray(repeats, jnp.int32)
    compiled = passes.lower(weights, x, n).compile()
    jax.block_until_ready(compiled(weights, x, n))
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compiled(weights, x, n))
        seconds.append((time.perf_counter() - start) / (repeats * len(weights)))
    return statistics.median(seconds)


def xla_int8_product(x, w):
    """XLA's product over int8 rows with a float32 scale each, as `PackedLinear` writes it off the kernel."""
    rows, scale = w
    y = jax.lax.dot_general(x, rows.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def xla_parts_int8_product(x, w):
    """x's two int8 parts (`int8_parts`) by the int8 rows in one int8 product (int32 sums), then
    high + low / LOW_STEPS times the row's and the column's scales."""
    rows, scale = w
    high, low, row_scale = int8_parts(x)
    y = jax.lax.dot_general(
        jnp.stack([high, low]), rows, (((2,), (1,)), ((), ())), preferred_element_type=jnp.int32
    ).astype(jnp.float32)
    return ((y[0] + y[1] * (1.0 / LOW_STEPS)) * row_scale[:, None] * scale).astype(x.dtype)


def kernel_int8_product(x, w):
    """`fused_linear` over int8 rows with the model's settings for it (`model.int8_kernel_settings`)."""
    return fused_linear(x, w[0], weight_scale=w[1], **model.int8_kernel_settings(w[0].shape[1]))


def run_int8(name, product, weights, rows_list, repeats, rates):
    """The product over int8 copies of `weights` (int8_rows.py), by XLA and by `fused_linear`."""
    int8 = [quantized_rows(w) for w in weights]
    n, k = weights[0].shape
    records = []
    for rows in rows_list:
        floor = rates.seconds(n * k + 4 * n, 2 * rows * n * k)
        xla = time_product(xla_int8_product, int8, rows, repeats)
        parts = time_product(xla_parts_int8_product, int8, rows, repeats)
        mine = time_product(kernel_int8_product, int8, rows, repeats)
        knobs = model.int8_kernel_settings(k)
        record = dict(shape=name, product=f"{product} int8", n=n, k=k, rows=rows, floor_us=1e6 * floor)
        records.append(
            dict(record, xla_us=1e6 * xla, xla_parts_us=1e6 * parts, kernel_us=1e6 * mine, kernel_config=knobs)
        )
        print(
            f"{name:<11}{product:<8} rows {rows:>3}, int8: floor {1e6 * floor:7.1f} us | XLA {1e6 * xla:7.1f}"
            f" ({xla / floor:4.2f}x) | XLA, int8 parts {1e6 * parts:7.1f} ({parts / floor:4.2f}x)"
            f" | fused_linear {1e6 * mine:7.1f} ({mine / floor:4.2f}x)"
        )
    return records


def run_product(
    name, product, n, k, rows_list, layers, repeats, configs, rates, int8=False, reduction=False, xla_splits=()
):
    key = jax.random.fold_in(jax.random.key(0), zlib.crc32(product.encode()))
    weights = [0.02 * jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) for i in range(layers)]
    floor = {rows: rates.seconds(n * k * 2, 2 * rows * n * k) for rows in rows_list}
    top = max(rows_list)
    sweep = []
    for config in (c for c in configs if fits(c, n, k)):
        try:
            seconds = time_product(streamed(*config), weights, top, repeats)
        except Exception as err:  # a config the compiler refuses is reported, not fatal
            print(f"{name} {product} {config}: failed: {str(err).splitlines()[0][:160]}")
            continue
        sweep.append((seconds, config))
        print(f"{name:<11}{product:<8} rows {top:>3} {config}: {1e6 * seconds:8.1f} us {seconds / floor[top]:5.2f}x")
    best = min(sweep)[1] if sweep else None
    records = []
    for rows in rows_list:
        xla = time_product(xla_product, weights, rows, repeats)
        mine = time_product(streamed(*best), weights, rows, repeats) if best else float("nan")
        records.append(
            dict(
                shape=name,
                product=product,
                n=n,
                k=k,
                rows=rows,
                floor_us=1e6 * floor[rows],
                xla_us=1e6 * xla,
                streamer_us=1e6 * mine,
                streamer_config=best,
                sweep=[(1e6 * s, c) for s, c in sweep] if rows == top else [],
            )  # fmt: skip
        )
        streamer = f" | streamer {best} {1e6 * mine:7.1f} ({mine / floor[rows]:4.2f}x)" if best else ""
        print(
            f"{name:<11}{product:<8} rows {rows:>3}: floor {1e6 * floor[rows]:7.1f} us | XLA {1e6 * xla:7.1f}"
            f" ({xla / floor[rows]:4.2f}x){streamer}"
        )
    if reduction:
        records += run_reduction(name, product, weights, rows_list, repeats, rates)
    if xla_splits:
        records += run_xla_splits(name, product, weights, rows_list, xla_splits, repeats, rates)
    return records + (run_int8(name, product, weights, rows_list, repeats, rates) if int8 else [])


def run_shape(name, rows_list, layers, repeats, configs, rates, int8=False, reduction=False, xla_splits=()):
    records = []
    for product, (n, k) in product_shapes(name).items():
        records += run_product(
            name, product, n, k, rows_list, layers, repeats, configs, rates, int8, reduction, xla_splits
        )
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama31_8b,vicuna7b")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help="the streamer's tile_n:splits:stages, comma-separated (empty: none)"
    )
    parser.add_argument(
        "--int8", action="store_true", help="also time each product over int8 rows (a draft's), by XLA and fused_linear"
    )
    parser.add_argument(
        "--reduction",
        action="store_true",
        help="also time each product as multiply-reduce (SMALL_ROWS' form) beside XLA's, both written out",
    )
    parser.add_argument(
        "--xla-splits",
        default="",
        help="also time XLA's product with K cut into each of these numbers of slices, as one batched product "
        "of float32 partials (comma-separated, e.g. 1,2,4)",
    )
    parser.add_argument("--json", help="write every timing here")
    args = parser.parse_args(argv)
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",") if c]  # "": XLA's alone
    rows_list = [int(r) for r in args.rows.split(",")]
    xla_splits = [int(s) for s in args.xla_splits.split(",") if s]
    rates = floors.measure_rates()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; floors at {rates.bandwidth / 1e9:.0f} GB/s")
    records = []
    for name in args.shapes.split(","):
        records += run_shape(
            name, rows_list, args.layers, args.repeats, configs, rates, args.int8, args.reduction, xla_splits
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
