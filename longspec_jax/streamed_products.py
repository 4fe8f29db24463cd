"""Which of a verify's products stream their weight through `pallas_kernels.row_matmul_mgpu` (Hopper's
TMA and wgmma) instead of XLA's GEMM, and with which knobs.

A verified block's 17-64 rows against a 7B layer's weight are bound by reading the weight, and the
streamer's time follows the weight bytes in flight across the GPU (BENCHMARKS.md, "A weight
streamer for a verify's few rows" and "A verify's narrow products on the weight streamer"). XLA's
GEMMs for the narrow products (Llama-3-8B's q|k|v, o and down, Vicuna-7B's o and down: a few
thousand output columns) leave part of the GPU idle; so those are cut into strips of 64 output
columns and, where the strips are too few to fill the GPU, slices of their input features too
(float32 partials summed after; narrower strips measured faster than more slices), with a ring of
`STAGES` tiles a block. On an H100 this made Llama-3-8B's verify at 32k 7.5 % faster. The wide
gate|up product already fills the GPU under XLA and stays XLA's, as do one-row AR steps, a draft
level's few rows, batched verifies past 64 rows and small models' products (their weights under
`MIN_WEIGHT_BYTES`: launches, not bytes, bound those). The rule goes by rows alone, so a draft
level of a batch (4 x 16 rows) streams too; that case was not timed.
"""

from __future__ import annotations

from pallas_kernels import row_matmul_mgpu

ROWS = range(17, row_matmul_mgpu.ROWS + 1)  # a verified block's (a batch-1 draft level has at most 16)
MIN_WEIGHT_BYTES = 16 << 20  # a 7B layer's smallest product (o: 32-34 MB); SmolLM2's are < 2 MB
BLOCKS_PER_SM = 0.7  # the fewest blocks a streamed product runs, per multiprocessor
WIDE_TILE_N = 128  # a product with at least that many blocks of this many columns is wide: XLA's
TILE_N = 64  # a streamed product's strip: narrower strips before more slices (slices add partials)
SPLITS = (1, 2, 4, 8)  # slices of the input features, fewest first
STAGES = 8  # ring slots a block: 8 x 16 KB


def streamer_knobs(rows: int, n: int, k: int, weight_bytes: int, *, num_sms: int) -> dict | None:
    """`row_matmul`'s knobs (tile_n, splits, stages) for rows x [n, k] weight of weight_bytes, or None
    where XLA's product stays (rows outside `ROWS`, a small or wide weight, or no knob that fits)."""
    fewest = BLOCKS_PER_SM * num_sms
    if rows not in ROWS or weight_bytes < MIN_WEIGHT_BYTES or n % TILE_N or n // WIDE_TILE_N >= fewest:
        return None
    for splits in SPLITS:
        if n // TILE_N * splits >= fewest and k % (row_matmul_mgpu.TILE_K * splits) == 0:
            return dict(tile_n=TILE_N, splits=splits, stages=STAGES)
    return None
