"""Every Pallas kernel lowers to a valid Triton module for the H200, checked on the CPU.

The interpret-mode tests run a kernel's jaxpr, not its Triton lowering, so an op or a type the
lowering gets wrong would first show on the GPU (a select of two untyped scalars, for one, lowers to
an i1 loop bound). Here each kernel is lowered for CUDA through JAX's Triton lowering, with an H200
standing in for the absent GPU, and MLIR verifies every module. It reaches into JAX's private Pallas
modules, as pinned in pyproject.toml.
"""

import jax
import jax.numpy as jnp
import pytest

from longspec_jax.model import int8_kernel_settings
from pallas_kernels.cache_attention import cache_attention
from pallas_kernels.commit_rows import commit_rows
from pallas_kernels.fused_linear import fused_linear
from pallas_kernels.head_top_k import head_top_k
from pallas_kernels.hybrid_attention import hybrid_attention, hybrid_attention_and_write
from pallas_kernels.residual_norm import residual_norm
from pallas_kernels.tree_attention import masked_attention


@pytest.fixture
def lowered_modules(monkeypatch):
    """The Triton modules of every pallas_call lowered while the fixture is active."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def lower_and_keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module)
        return result

    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", lower_and_keep)
    return modules


def lower_for_cuda(fn, *shapes):
    jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))


def assert_valid_modules(modules, names) -> None:
    assert {m.operation.attributes["sym_name"].value for m in modules} == names
    for module in modules:
        with module.context:
            assert module.operation.verify()


# (B, T, Hq, Hkv, S, D): SmolLM2 verify and one-token steps, 7B verify (GQA; no GQA in 64-row blocks).
SHAPES = [(1, 21, 9, 3, 4608, 64), (2, 1, 9, 3, 4608, 64), (1, 74, 32, 8, 32768, 128), (1, 64, 32, 32, 32768, 128)]
KERNELS = {
    "hybrid": ({"hybrid_split_k_attn", "split_k_combine"}, hybrid_attention, "q kc vc len kn vn mask"),
    "hybrid_write": (
        {"hybrid_split_k_attn_write", "split_k_combine"},
        lambda qkv, *rest, interpret: hybrid_attention_and_write(
            qkv, *rest, num_heads=qkv.shape[2] - 2 * rest[2].shape[2], interpret=interpret
        ),
        "qkv cos sin kc vc len mask",
    ),
    "cache": ({"cache_split_k_attn", "split_k_combine"}, cache_attention, "q kc vc len"),
    "masked": ({"fused_mask_attn"}, masked_attention, "q kn vn mask"),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("b,t,hq,hkv,s,d", SHAPES)
def test_kernels_lower_to_valid_triton_modules(lowered_modules, kernel, b, t, hq, hkv, s, d):
    names, fn, arg_names = KERNELS[kernel]
    bf16 = jnp.bfloat16
    shapes = {
        "q": jax.ShapeDtypeStruct((b, t, hq, d), bf16),
        "kc": jax.ShapeDtypeStruct((b, s, hkv, d), bf16),
        "vc": jax.ShapeDtypeStruct((b, s, hkv, d), bf16),
        "len": jax.ShapeDtypeStruct((b,), jnp.int32),
        "kn": jax.ShapeDtypeStruct((b, t, hkv, d), bf16),
        "vn": jax.ShapeDtypeStruct((b, t, hkv, d), bf16),
        "mask": jax.ShapeDtypeStruct((b, t, t), jnp.bool_),
        "qkv": jax.ShapeDtypeStruct((b, t, hq + 2 * hkv, d), bf16),
        "cos": jax.ShapeDtypeStruct((b, t, d // 2), jnp.float32),
        "sin": jax.ShapeDtypeStruct((b, t, d // 2), jnp.float32),
    }
    lower_for_cuda(lambda *args: fn(*args, interpret=False), *(shapes[a] for a in arg_names.split()))
    assert_valid_modules(lowered_modules, names)


# (B, layers, T, A, S, Hkv, D): SmolLM2 verify at batch 1 and 2 (bf16 cache, float32 block rows
# cast on the way), a 7B-like layout.
COMMIT_SHAPES = [
    (1, 30, 21, 6, 4608, 3, 64, jnp.bfloat16),
    (2, 30, 21, 6, 4608, 3, 64, jnp.float32),
    (1, 32, 74, 9, 32768, 8, 128, jnp.bfloat16),
]


@pytest.mark.parametrize("b,layers,t,a,s,hkv,d,block_dtype", COMMIT_SHAPES)
def test_commit_rows_lowers_to_a_valid_triton_module(lowered_modules, b, layers, t, a, s, hkv, d, block_dtype):
    caches = [jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16)] * (2 * layers)
    blocks = [jax.ShapeDtypeStruct((b, t, hkv, d), block_dtype)] * (2 * layers)
    path, lengths = jax.ShapeDtypeStruct((b, a), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)
    n = 2 * layers
    lower_for_cuda(
        lambda *args: commit_rows(args[:n], args[n : 2 * n], *args[2 * n :], interpret=False),
        *caches,
        *blocks,
        path,
        lengths,
    )
    assert_valid_modules(lowered_modules, {"commit_rows"})


@pytest.mark.parametrize("b,layers,t,a,s,hkv,d,block_dtype", COMMIT_SHAPES[::2])
def test_commit_rows_in_cache_lowers_to_a_valid_triton_module(lowered_modules, b, layers, t, a, s, hkv, d, block_dtype):
    """The in-cache move (the rows the attention kernel wrote past the cache end), with its barrier."""
    del t, block_dtype
    caches = [jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16)] * (2 * layers)
    path, lengths = jax.ShapeDtypeStruct((b, a), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)
    n = 2 * layers
    lower_for_cuda(lambda *args: commit_rows(args[:n], None, *args[n:], interpret=False), *caches, path, lengths)
    assert_valid_modules(lowered_modules, {"commit_rows_in_cache"})
    assert any("barrier" in str(module) for module in lowered_modules)


@pytest.mark.parametrize("r,v,h,k", [(1, 49152, 576, 16), (64, 49152, 576, 4), (16, 128256, 4096, 16)])
def test_head_top_k_lowers_to_valid_triton_modules(lowered_modules, r, v, h, k):
    x, w = jax.ShapeDtypeStruct((r, h), jnp.bfloat16), jax.ShapeDtypeStruct((v, h), jnp.bfloat16)
    lower_for_cuda(lambda x, w: head_top_k(x, w, k, interpret=False), x, w)
    assert_valid_modules(lowered_modules, {"head_top_k_tiles", "head_top_k_merge"})


@pytest.mark.parametrize("r,v,h,k", [(1, 128256, 4096, 16), (16, 32000, 4096, 16), (64, 49152, 576, 4)])
def test_head_top_k_of_an_int8_head_lowers_to_valid_triton_modules(lowered_modules, r, v, h, k):
    """A 7B draft's int8 head (draft_head.py) with its scale a row, a bf16 hidden state."""
    x, w = jax.ShapeDtypeStruct((r, h), jnp.bfloat16), jax.ShapeDtypeStruct((v, h), jnp.int8)
    scale = jax.ShapeDtypeStruct((v,), jnp.float32)
    lower_for_cuda(lambda x, w, s: head_top_k(x, w, k, head_scale=s, interpret=False), x, w, scale)
    assert_valid_modules(lowered_modules, {"head_top_k_tiles", "head_top_k_merge"})


@pytest.mark.parametrize("g,w,k", [(1, 4, 4), (2, 16, 2)])
def test_head_top_k_with_noise_lowers_to_valid_triton_modules(lowered_modules, g, w, k):
    """A sampling tree's coupled candidates at SmolLM2's head: a noise row per group of rows."""
    v, h = 49152, 576
    x, head = jax.ShapeDtypeStruct((g * w, h), jnp.bfloat16), jax.ShapeDtypeStruct((v, h), jnp.bfloat16)
    noise = jax.ShapeDtypeStruct((g, v), jnp.float32)
    lower_for_cuda(lambda x, head, noise: head_top_k(x, head, k, noise=noise, interpret=False), x, head, noise)
    assert_valid_modules(lowered_modules, {"head_top_k_tiles", "head_top_k_merge"})


# (M, N, K, swiglu, the optional arrays): SmolLM2's projections (qkv, o, gate|up, down) at 1 and 69
# rows and a 7B's at 74, bf16; a bias on one.
FUSED_LINEAR_SHAPES = [
    (1, 960, 576, False, "norm_weight"),
    (69, 960, 576, False, "norm_weight bias"),
    (69, 576, 576, False, "residual"),
    (69, 3072, 576, False, "norm_weight"),
    (69, 576, 1536, True, "residual"),
    (74, 12288, 4096, False, "norm_weight"),
    (74, 4096, 11008, True, "residual"),
]


@pytest.mark.parametrize("m,n,k,swiglu,extras", FUSED_LINEAR_SHAPES)
def test_fused_linear_lowers_to_a_valid_triton_module(lowered_modules, m, n, k, swiglu, extras):
    shapes = {"norm_weight": (k,), "bias": (n,), "residual": (m, n)}
    names = extras.split()
    x = jax.ShapeDtypeStruct((m, 2 * k if swiglu else k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n, k), jnp.bfloat16)
    arrays = [jax.ShapeDtypeStruct(shapes[name], jnp.bfloat16) for name in names]
    lower_for_cuda(
        lambda x, w, *arrays: fused_linear(x, w, swiglu=swiglu, interpret=False, **dict(zip(names, arrays))),
        x,
        w,
        *arrays,
    )
    assert_valid_modules(lowered_modules, {"fused_linear"})


# A 7B draft's int8 products (int8_rows.py) at a level's 16 rows and batch 4's 64, with the model's
# settings for them (`model.int8_kernel_settings`), and one with a bias and a residual.
@pytest.mark.parametrize(
    "m,n,k,extras",
    [(16, 6144, 4096, ""), (16, 28672, 4096, ""), (64, 4096, 14336, ""), (1, 4096, 4096, "bias residual")],
)
def test_fused_linear_over_int8_rows_lowers_to_a_valid_triton_module(lowered_modules, m, n, k, extras):
    knobs = int8_kernel_settings(k)
    shapes = {"bias": (n,), "residual": (m, n)}
    names = extras.split()
    x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.int8)
    scale = jax.ShapeDtypeStruct((n,), jnp.float32)
    arrays = [jax.ShapeDtypeStruct(shapes[name], jnp.bfloat16) for name in names]
    lower_for_cuda(
        lambda x, w, s, *arrays: fused_linear(
            x, w, weight_scale=s, interpret=False, **knobs, **dict(zip(names, arrays))
        ),
        x,
        w,
        scale,
        *arrays,
    )
    assert_valid_modules(lowered_modules, {"fused_linear"})


# An AR step's row at SmolLM2's width (masked lanes) and a 7B's, a verify's 74 rows at Qwen2.5-7B's.
@pytest.mark.parametrize("rows,width", [(1, 576), (4, 4096), (74, 3584)])
def test_residual_norm_lowers_to_a_valid_triton_module(lowered_modules, rows, width):
    x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
    lower_for_cuda(lambda x, d: residual_norm(x, d, 1e-5, interpret=False), x, x)
    assert_valid_modules(lowered_modules, {"residual_norm"})


def test_residual_norm_over_a_split_products_partials_lowers(lowered_modules):
    """A 7B verify's 20 rows after a streamed product: two float32 slices over 64 padded rows."""
    x = jax.ShapeDtypeStruct((1, 20, 4096), jnp.bfloat16)
    partials = jax.ShapeDtypeStruct((2, 64, 4096), jnp.float32)
    lower_for_cuda(lambda x, p: residual_norm(x, p, 1e-5, partials=True, interpret=False), x, partials)
    assert_valid_modules(lowered_modules, {"residual_norm"})
