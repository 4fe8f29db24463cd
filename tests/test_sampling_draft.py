"""A second draft for the requests that sample: a Generator decodes greedy requests with its draft
and sampled ones with its sampling draft (the shipped pair for the embedded SmolLM2, or any given),
in the fixed mode and in mode auto, and keeps each one's acceptance memory apart."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from longspec_jax import acceptance_memory, generation
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_io import inference_draft, init_draft
from longspec_jax.generation import Generator
from longspec_jax.sampling import SamplingSettings
from tests.test_speculative import WIDTHS, sharpened_target

MAX_NEW = 16


@pytest.fixture(scope="module")
def target():
    return sharpened_target(vocab_size=48, eos_token_ids=())


def sharp_draft(target, seed):
    draft = init_draft(target, seed=seed, config=DraftConfig(window=8))
    _, variables = nnx.split(draft.block)
    nnx.update(draft.block, jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x, variables))
    return draft


@pytest.fixture(scope="module")
def drafts(target):
    return sharp_draft(target, seed=1), sharp_draft(target, seed=2)


PROMPTS = [[3, 17, 9, 40, 22, 5, 31, 8, 12, 44, 1, 27, 19], [6, 30, 2, 11, 38, 25]]


@pytest.fixture(autouse=True)
def no_memory_between_requests(monkeypatch, tmp_path):
    """Mode auto starts each request from what earlier ones kept (acceptance_memory.py) and times
    its candidates on the first request of a kind (calibration.py): here every request starts
    afresh from fixed costs (a draft round at half an AR step's), so that two Generators' runs compare."""
    monkeypatch.setattr(acceptance_memory, "memory_folder", lambda: None)

    def fixed_costs(state, run, names, key):
        return state, np.asarray([1.0] + [0.5] * (len(names) - 1)), "kept"

    monkeypatch.setattr(generation, "calibrated", fixed_costs)
    acceptance_memory.forget_memory()
    yield
    acceptance_memory.forget_memory()


def run(generator, temperature):
    acceptance_memory.forget_memory()
    result = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=temperature, seed=5, eos_token_ids=())
    return result.tokens, result.stats.rounds


@pytest.mark.parametrize("mode,widths", [("longspec", WIDTHS), ("auto", None)])
def test_greedy_requests_use_the_draft_and_sampled_ones_the_sampling_draft(target, drafts, mode, widths):
    greedy_draft, sampling_draft = drafts
    both = Generator(target, greedy_draft, sampling_draft=sampling_draft, mode=mode, tree_widths=widths)
    only_greedy = Generator(target, greedy_draft, mode=mode, tree_widths=widths)
    only_sampling = Generator(target, sampling_draft, mode=mode, tree_widths=widths)
    assert run(both, 0.0) == run(only_greedy, 0.0)
    sampled = run(both, 1.0)
    assert sampled == run(only_sampling, 1.0)
    assert sampled != run(only_greedy, 1.0)  # the two drafts do tell apart here
    assert both.draft_for(SamplingSettings.checked(0.0)) is greedy_draft
    assert both.draft_for(SamplingSettings.checked(1.0)) is sampling_draft


def test_a_given_draft_samples_too_and_the_shipped_pair_is_found(target, drafts, tmp_path):
    greedy_draft, sampling_draft = drafts
    assert Generator(target, greedy_draft).draft_for(SamplingSettings.checked(1.0)) is greedy_draft

    greedy_draft.save(tmp_path / "greedy")
    sampling_draft.save(tmp_path / "sampling")
    shipped = sharpened_target(vocab_size=48, eos_token_ids=())
    shipped.shipped_draft = tmp_path / "greedy"
    shipped.shipped_sampling_draft = tmp_path / "sampling"
    for mode in ("auto", "longspec"):
        generator = Generator(shipped, mode=mode)
        assert run(generator, 1.0) == run(Generator(target, sampling_draft, mode=mode), 1.0)
        assert run(generator, 0.0) == run(Generator(target, greedy_draft, mode=mode), 0.0)
    assert Generator(shipped, mode="ar").sampling_draft is None
    # a target that ships one draft samples with it
    shipped.shipped_sampling_draft = None
    assert inference_draft(shipped, sampling=True) is not None
    assert run(Generator(shipped), 1.0) == run(Generator(target, greedy_draft), 1.0)


def test_the_benchmark_loads_a_sampling_draft_or_samples_with_the_draft(tmp_path):
    from infer.benchmark import load_models
    from longspec_jax.target import load_target
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    path = str(save_tiny_checkpoint(tmp_path / "target", tiny_config()))
    loaded = load_target(path, dtype="float32")
    greedy_path = init_draft(loaded, seed=1).save(tmp_path / "greedy")
    sampling_path = init_draft(loaded, seed=2, config=DraftConfig(window=8)).save(tmp_path / "sampling")

    _, draft, sampling_draft = load_models(path, str(greedy_path), None, "float32", True)
    assert sampling_draft is draft  # --draft alone serves every request
    _, draft, sampling_draft = load_models(path, str(greedy_path), str(sampling_path), "float32", True)
    assert draft.config.window != 8 and sampling_draft.config.window == 8
    _, draft, sampling_draft = load_models(path, None, str(sampling_path), "float32", True)
    assert draft is None and sampling_draft.config.window == 8  # this target ships no draft
    assert load_models(path, str(greedy_path), str(sampling_path), "float32", False)[1:] == (None, None)
