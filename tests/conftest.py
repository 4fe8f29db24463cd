import gc
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache stays off in the tests: a clean run gains nothing from it and
# would write an entry for each of its thousands of programs. tests/test_compile_cache.py turns it on
# for the processes it starts.
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_after_each_module():
    """Every CPU executable keeps its machine code in memory mappings of its own until it is freed. A
    test worker that kept every program of the suite reached ~65,000 mappings, the kernel's default
    limit (vm.max_map_count 65,530), and crashed inside XLA's compiler; freed after each module, the
    most a worker held in a full run was 9,285 (2026-12-04)."""
    yield
    from longspec_jax.decode_kit import forget_compiled

    forget_compiled()
    gc.collect()
