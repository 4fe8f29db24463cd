import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache stays off in the tests: writing an entry (XLA serialising a CPU
# executable) crashed a test worker with a segmentation fault once (2026-12-04), and the crashed
# worker left the run hanging. tests/test_compile_cache.py turns it on for the processes it starts.
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
