"""The shipped SmolLM2 draft is found by the GGUF's content: the embedded file and any byte-identical
copy get it, whatever their path; any other GGUF (even one of the same size) does not."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from longspec_jax import embedded
from longspec_jax.embedded import (
    default_draft_dir,
    default_sampling_draft_dir,
    shipped_draft_for_gguf,
    shipped_sampling_draft_for_gguf,
    smollm2_gguf_path,
)
from longspec_jax.generation import Generator
from longspec_jax.target import load_target
from tests.test_gguf_cache import write_tiny_gguf


@pytest.fixture(scope="module")
def smollm2_copy(tmp_path_factory):
    copy = tmp_path_factory.mktemp("elsewhere") / "my-model.gguf"
    shutil.copyfile(smollm2_gguf_path(), copy)
    return copy


@pytest.fixture
def hashes(monkeypatch):
    """The files shipped_draft_for_gguf hashes."""
    hashed = []
    original = embedded.file_sha256

    def counted(path):
        hashed.append(path)
        return original(path)

    monkeypatch.setattr(embedded, "file_sha256", counted)
    return hashed


def test_the_embedded_gguf_and_a_copy_elsewhere_get_the_shipped_draft(smollm2_copy):
    assert (default_draft_dir() / "config.json").is_file()
    assert shipped_draft_for_gguf(smollm2_gguf_path()) == default_draft_dir()
    assert shipped_draft_for_gguf(smollm2_copy) == default_draft_dir()
    assert (default_sampling_draft_dir() / "config.json").is_file()
    assert shipped_sampling_draft_for_gguf(smollm2_copy) == default_sampling_draft_dir()


def test_a_gguf_of_the_same_size_with_other_bytes_gets_none(tmp_path, smollm2_copy):
    altered = tmp_path / smollm2_gguf_path().name
    data = bytearray(smollm2_copy.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one weight
    altered.write_bytes(bytes(data))
    assert altered.stat().st_size == smollm2_gguf_path().stat().st_size
    assert shipped_draft_for_gguf(altered) is None
    assert shipped_sampling_draft_for_gguf(altered) is None


def test_another_gguf_gets_none_without_hashing_anything(tmp_path, hashes):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    assert shipped_draft_for_gguf(path) is None
    assert hashes == []  # the size alone settles it


def test_target_loaded_from_a_copy_decodes_with_the_shipped_draft(smollm2_copy):
    assert load_target(None, dtype="float32").shipped_draft == default_draft_dir()
    target = load_target(smollm2_copy, dtype="float32")
    assert target.shipped_draft == default_draft_dir()
    assert target.shipped_sampling_draft == default_sampling_draft_dir()
    generator = Generator(target)
    assert generator.mode == "auto" and generator.draft is not None
    assert generator.draft.config.window == 512
    # two drafts of one shape, different weights: greedy requests get one, sampled ones the other
    assert generator.sampling_draft is not generator.draft
    assert generator.sampling_draft.config == generator.draft.config
    greedy_weights = jax.tree.leaves(nnx.state(generator.draft.block))
    sampling_weights = jax.tree.leaves(nnx.state(generator.sampling_draft.block))
    assert any(not np.array_equal(a, b) for a, b in zip(greedy_weights, sampling_weights))


def test_target_from_another_gguf_decodes_ar(tmp_path, monkeypatch):
    from longspec_jax import gguf_cache

    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    target = load_target(path, dtype="float32")
    assert target.shipped_draft is None and target.shipped_sampling_draft is None
    assert Generator(target).draft is None and Generator(target).sampling_draft is None
