"""benchmarks/auto_candidates.py: candidate names parsed into mode auto's plan, and the replaced
plan reaching the requests it names (and only those) through the Generator."""

import argparse

import pytest

from benchmarks.auto_candidates import parse_candidates, replaced_plan
from longspec_jax import generation
from longspec_jax.adaptive import candidate_plan
from longspec_jax.draft import DraftConfig
from longspec_jax.draft_io import init_draft
from longspec_jax.generation import DecodeRequest, Generator
from longspec_jax.sampling import SamplingSettings
from tests.test_speculative import sharpened_target


def test_names_become_the_plan_mode_auto_takes():
    assert parse_candidates("ar;pld 2;tree 4,4,4") == (("ar", ()), ("pld 2", (1, 1)), ("tree 4,4,4", (4, 4, 4)))
    assert parse_candidates(" ar ; tree 1") == (("ar", ()), ("tree 1", (1,)))


@pytest.mark.parametrize("text", ["tree 4,4,4", "ar;tree", "ar;tree 4,0", "ar;pld x", "ar;beam 4", ""])
def test_bad_candidate_sets_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_candidates(text)


def test_the_set_replaces_only_the_requests_it_names():
    lean = parse_candidates("ar;tree 4,4,4")
    choose = replaced_plan(lean, "sampled", {1})
    assert choose(True, False, 1) == lean
    assert choose(True, True, 1) == candidate_plan(True, True, 1)  # greedy keeps the default
    assert choose(True, False, 4) == candidate_plan(True, False, 4)  # so does another batch size
    assert choose(False, False, 1) == candidate_plan(False, False, 1)  # a tree needs a draft
    chains = parse_candidates("ar;pld 3")
    assert replaced_plan(chains, "all", None)(False, True, 8) == chains


def test_the_generator_builds_the_replaced_set(monkeypatch):
    target = sharpened_target(seed=4, vocab_size=40, eos_token_ids=())
    draft = init_draft(target, seed=5, config=DraftConfig(window=8))
    monkeypatch.setattr(generation, "candidate_plan", replaced_plan(parse_candidates("ar;tree 2,2"), "sampled", {1}))
    generator = Generator(target, draft)

    def names(temperature, batch):
        request = DecodeRequest(
            max_new_tokens=4,
            sampling=SamplingSettings.checked(temperature),
            seed=0,
            eos_token_ids=(),
            stream=None,
            stream_every=1,
            profile=False,
        )
        return generator.proposer_for_request(request, batch)[0].names

    assert names(1.0, 1) == ("ar", "tree 2,2")
    assert names(0.0, 1) == tuple(name for name, _ in candidate_plan(True, True, 1))
