"""Matrices read as int8 where the products they feed need not be exact: a draft's LM head and its
block (the target's check decides every token, so the draft's choices may be approximate). Each
row of a matrix [rows, features] is quantised symmetrically with its own float32 scale: half the
bytes of bfloat16, which is what a draft level costs at 7B sizes (it reads a few rows' worth of
work from hundreds of megabytes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longspec_jax.errors import UserError

# "auto" reads a draft's part as int8 from this many bytes (in its own dtype): a 7B's head and
# block (0.26-1.05 GB and ~0.5 GB); not the embedded SmolLM2's (19 MB and ~10 MB), whose levels are
# bound by how many kernels they run, not by their bytes.
INT8_MIN_BYTES = 64 * 2**20


@jax.jit
def quantized_rows(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """rows [C, H] -> (int8 [C, H], float32 scale [C]): each row symmetric, scale = max |row| / 127
    (1 for a row of zeros), q = round(row / scale)."""
    wide = rows.astype(jnp.float32)
    peak = jnp.max(jnp.abs(wide), axis=1)
    scale = jnp.where(peak > 0, peak / 127.0, 1.0)
    return jnp.clip(jnp.round(wide / scale[:, None]), -127, 127).astype(jnp.int8), scale


# How a draft's block holds its matrices: "full" in the dtype it runs in, "int8" as int8 rows,
# "auto" int8 from INT8_MIN_BYTES.
BLOCK_FORMATS = ("auto", "int8", "full")


def check_block_format(block_format: str) -> str:
    """block_format if it is one of BLOCK_FORMATS, else a UserError naming them."""
    if block_format not in BLOCK_FORMATS:
        raise UserError(f"unknown draft block format {block_format!r}: choose one of {', '.join(BLOCK_FORMATS)}")
    return block_format


def takes_int8(checked_format: str, nbytes: int) -> bool:
    """Whether a draft's part (its head or its block) of `nbytes` in its own dtype is read as int8
    under `checked_format` (one of its formats, checked): "int8" yes, "auto" from INT8_MIN_BYTES,
    any other no."""
    return nbytes >= INT8_MIN_BYTES if checked_format == "auto" else checked_format == "int8"


def block_reads_int8(block_format: str, nbytes: int) -> bool:
    """Whether a draft block of `nbytes` (its parameters in the dtype it runs in) holds int8 matrices."""
    return takes_int8(check_block_format(block_format), nbytes)
