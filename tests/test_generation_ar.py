"""AR generation (generation.py, the loop with a proposer that proposes nothing) on tiny random
float32 targets against step-by-step full forwards; the public API's input checks and Ctrl-C."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax import decode_kit
from longspec_jax.decode_kit import bucket_length
from longspec_jax.errors import GenerationInterrupted, UserError
from longspec_jax.generation import Generator, generate
from longspec_jax.target import random_target
from tests.tiny_models import tiny_config


def sharpened(target, scale=10.0):
    """Scale every matrix (std 0.02 -> 0.2) so logits are O(1) and argmax margins are not rounding noise."""
    _, params = nnx.split(target.model)
    nnx.update(target.model, jax.tree.map(lambda x: x * scale if x.ndim == 2 else x, params))
    return target


@pytest.fixture(scope="module")
def target():
    return sharpened(random_target(tiny_config(), seed=0, dtype="float32"))


def greedy_reference(target, prompt, n):
    """Greedy continuation by argmax of forward_logits over the whole sequence, one token at a time.
    The sequence is right-padded to one length (causal: padding after a position cannot change
    its logits) so forward_logits compiles once."""
    seq = list(prompt)
    padded_len = len(prompt) + n
    for _ in range(n):
        padded = seq + [0] * (padded_len - len(seq))
        logits = np.asarray(target.forward_logits(jnp.asarray([padded])))[0, len(seq) - 1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3, "near-tie: the comparison would test rounding, pick another seed"
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


PROMPT_A = [5, 17, 3, 99, 42]
PROMPT_B = [7, 1, 64, 8, 23, 11, 90, 31, 2, 55, 6]


def test_greedy_equals_argmax_of_full_forward(target):
    result = generate(target, PROMPT_A, mode="ar", max_new_tokens=9, eos_token_ids=())
    assert result.tokens == [greedy_reference(target, PROMPT_A, 9)]
    assert result.stats.new_tokens == 9 and result.stats.rounds == 8 and result.stats.tau == 1.0
    assert result.stats.target_cache_bytes > 0 and result.stats.draft_cache_bytes == 0


def test_batch_of_different_lengths_equals_each_alone(target):
    together = generate(target, [PROMPT_A, PROMPT_B], mode="ar", max_new_tokens=9, eos_token_ids=()).tokens
    alone = [generate(target, p, mode="ar", max_new_tokens=9, eos_token_ids=()).tokens[0] for p in (PROMPT_A, PROMPT_B)]
    assert together == alone


def test_eos_truncates_and_max_new_tokens_is_exact(target):
    free = generate(target, [PROMPT_A, PROMPT_B], mode="ar", max_new_tokens=11, eos_token_ids=()).tokens
    assert [len(t) for t in free] == [11, 11]
    # An EOS id that sequence A emits first at index 3 (and B, if at all, elsewhere).
    eos = free[0][3]
    assert eos not in free[0][:3]
    cut = generate(target, [PROMPT_A, PROMPT_B], mode="ar", max_new_tokens=11, eos_token_ids=(eos,)).tokens
    assert cut[0] == free[0][:4]
    b_end = free[1].index(eos) + 1 if eos in free[1] else 11
    assert cut[1] == free[1][:b_end]
    assert generate(target, PROMPT_A, mode="ar", max_new_tokens=1, eos_token_ids=()).tokens == [free[0][:1]]


def test_streaming_gives_the_same_tokens_in_growing_prefixes(target):
    seen = []
    result = generate(
        target, PROMPT_B, mode="ar", max_new_tokens=10, eos_token_ids=(), stream=seen.append, stream_every=3
    )
    assert len(seen) >= 3
    assert all(s[0] == result.tokens[0][: len(s[0])] for s in seen) and seen[-1] == result.tokens
    assert result.tokens == generate(target, PROMPT_B, mode="ar", max_new_tokens=10, eos_token_ids=()).tokens


def test_streamed_calls_run_about_stream_every_tokens_at_the_tau_seen():
    from longspec_jax.generation import stream_rounds

    assert stream_rounds(32, 1.0) == 32  # AR: one token a round
    assert stream_rounds(32, 4.0) == 8  # a round keeps four: a quarter of the rounds
    assert stream_rounds(32, 0.5) == 32  # never more rounds than tokens
    assert stream_rounds(2, 6.0) == 1  # at least one round a call


def test_prompts_in_one_bucket_compile_once_and_profile_reports_steps(target):
    gen = Generator(target, mode="ar")
    gen.generate([1, 2, 3], max_new_tokens=5, temperature=0.9, top_p=0.8, seed=1)
    again = gen.generate([4, 5, 6, 7, 8, 9], max_new_tokens=7, temperature=0.5, top_p=0.9, seed=2, profile=True)
    assert again.stats.compile_s == 0.0
    assert set(again.stats.profile) == {
        "step_in_loop_ms",
        "step_alone_ms",
        "draft_ms",
        "verify_ms",
        "accept_ms",
        "parts_sum_ms",
    }
    assert all(np.isfinite(v) and v > 0 for v in again.stats.profile.values())


def test_a_repeated_shape_neither_traces_nor_keys_the_compile_cache(target, monkeypatch):
    """A Generator's second request of a shape reuses its programs: no `start` traced for its
    output's shapes, no compile-cache key hashed (each costs milliseconds of host time)."""
    from longspec_jax import generation

    gen = Generator(target, mode="ar")
    first = gen.generate(PROMPT_A, max_new_tokens=6, eos_token_ids=())
    calls = []
    monkeypatch.setattr(generation.jax, "eval_shape", lambda *a, **k: calls.append("eval_shape"))
    monkeypatch.setattr(generation, "compiled", lambda *a, **k: calls.append("compiled"))
    again = gen.generate(PROMPT_A, max_new_tokens=6, eos_token_ids=())
    assert calls == []
    assert again.tokens == first.tokens and again.stats.compile_s == 0.0


def test_the_parameters_a_call_passes_are_plain_containers(target):
    """Every call of a compiled program flattens its arguments; the weights go as nested dicts of
    arrays, whose flattening stays in C++ (an nnx.State's Variable nodes flatten through Python)."""
    gen = Generator(target, mode="ar")
    structure = str(jax.tree.structure(gen.params))
    assert "CustomNode" not in structure and len(jax.tree.leaves(gen.params)) == len(
        jax.tree.leaves(nnx.state(target.decode_model()))
    )
    assert "CustomNode" in str(jax.tree.structure(nnx.state(target.decode_model())))  # what it replaced


def test_a_short_request_runs_in_one_call_and_a_long_one_in_chunks(target, monkeypatch):
    from longspec_jax import generation

    gen = Generator(target, mode="ar")
    short = gen.generate(PROMPT_A, max_new_tokens=20, eos_token_ids=(), profile=True)
    assert [r["what"] for r in short.stats.runs] == ["start", "loop"]
    assert short.stats.rounds == 19
    monkeypatch.setattr(generation, "WHOLE_REQUEST_ROUNDS", 8)
    monkeypatch.setattr(generation, "CHUNK_ROUNDS", 8)
    chunked = gen.generate(PROMPT_A, max_new_tokens=20, eos_token_ids=(), profile=True)
    assert [r["rounds"] for r in chunked.stats.runs] == [0, 8, 8, 3]
    assert chunked.tokens == short.tokens
    unprofiled = gen.generate(PROMPT_A, max_new_tokens=20, eos_token_ids=())  # no wait after start
    assert [(r["what"], r["rounds"]) for r in unprofiled.stats.runs] == [("loop", 8), ("loop", 8), ("loop", 3)]


def test_greedy_and_sampling_share_one_compiled_program(target):
    """Switching temperature 0 <-> > 0 (and the seed, top-k / top-p values while on) adds no
    entry to the compile cache; turning top-k on is a new program (a vocabulary sort)."""
    gen = Generator(target, mode="ar")
    gen.generate(PROMPT_A, max_new_tokens=6, eos_token_ids=())
    programs = len(decode_kit._COMPILED)
    greedy = gen.generate(PROMPT_A, max_new_tokens=6, eos_token_ids=())
    sampled = gen.generate(PROMPT_A, max_new_tokens=6, temperature=0.8, seed=5, eos_token_ids=())
    again = gen.generate(PROMPT_A, max_new_tokens=6, temperature=0.0, eos_token_ids=())
    assert len(decode_kit._COMPILED) == programs
    assert sampled.stats.compile_s == again.stats.compile_s == 0.0
    assert again.tokens == greedy.tokens == [greedy_reference(target, PROMPT_A, 6)]
    gen.generate(PROMPT_A, max_new_tokens=6, temperature=0.8, top_k=5, eos_token_ids=())
    assert len(decode_kit._COMPILED) > programs


def test_ctrl_c_keeps_the_tokens_made_so_far(target):
    """A KeyboardInterrupt after the first streamed chunk -> GenerationInterrupted whose result
    holds that chunk's tokens: the AR prefix."""
    full = generate(target, [PROMPT_A, PROMPT_B], mode="ar", max_new_tokens=10, eos_token_ids=()).tokens
    chunks = []

    def interrupt_after_first_chunk(tokens):
        chunks.append(tokens)
        raise KeyboardInterrupt

    with pytest.raises(GenerationInterrupted) as caught:
        generate(
            target,
            [PROMPT_A, PROMPT_B],
            mode="ar",
            max_new_tokens=10,
            eos_token_ids=(),
            stream=interrupt_after_first_chunk,
            stream_every=3,
        )
    result = caught.value.result
    assert isinstance(caught.value, KeyboardInterrupt)
    assert result.tokens == chunks[0] == [t[:4] for t in full]  # the prefill token + 3 rounds
    assert result.stats.new_tokens == 8 and result.stats.rounds == 3


def test_ctrl_c_before_any_chunk_finished_carries_no_result(target, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    gen = Generator(target, mode="ar")
    gen.generate(PROMPT_A, max_new_tokens=4, eos_token_ids=())  # compiled
    monkeypatch.setattr("longspec_jax.generation._Progress.read", interrupted)
    with pytest.raises(GenerationInterrupted) as caught:
        gen.generate(PROMPT_A, max_new_tokens=4, eos_token_ids=())
    assert caught.value.result is None


def test_sampling_is_reproducible_per_seed(target):
    run = lambda seed: (
        generate(target, PROMPT_A, mode="ar", max_new_tokens=8, temperature=1.0, top_p=0.95, seed=seed).tokens
    )
    assert run(3) == run(3)
    assert len({tuple(run(s)[0]) for s in range(4)}) > 1


def test_first_token_distribution_matches_the_filtered_softmax():
    vocab, temperature, top_k = 8, 0.7, 6
    target = sharpened(random_target(tiny_config(vocab_size=vocab, eos_token_ids=()), seed=1, dtype="float32"), 5.0)
    prompt = [1, 5, 2, 7]
    logits = np.asarray(target.forward_logits(jnp.asarray([prompt])), np.float64)[0, -1] / temperature
    logits = np.where(logits >= np.sort(logits)[-top_k], logits, -np.inf)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    draws = np.concatenate(
        [
            np.asarray(
                generate(
                    target, [prompt] * 400, mode="ar", max_new_tokens=1, temperature=temperature, top_k=top_k, seed=s
                ).tokens
            )[:, 0]
            for s in range(5)
        ]
    )
    counts = np.bincount(draws, minlength=vocab)
    assert counts[p == 0].sum() == 0
    n = len(draws)
    expected = n * p[p > 0]
    assert expected.min() > 5, "too few expected draws per token for a chi-square test"
    chi2 = np.sum((counts[p > 0] - expected) ** 2 / expected)
    assert chi2 < 20.5  # the 99.9% quantile of chi-square with 5 degrees of freedom


def test_token_ids_of_any_integer_type_pass_and_bools_do_not():
    from longspec_jax.decode_kit import normalize_prompts

    assert normalize_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert normalize_prompts([[np.int64(4), 5], [6]]) == [[4, 5], [6]]
    assert all(type(t) is int for t in normalize_prompts([np.int32(7), 8])[0])
    with pytest.raises(UserError, match="token ids must be integers, got True"):
        normalize_prompts([[1, True]])


def test_bad_inputs_raise_user_errors(target):
    with pytest.raises(UserError, match="empty prompt"):
        generate(target, [], mode="ar", max_new_tokens=4)
    with pytest.raises(UserError, match="empty prompt"):
        generate(target, [[1, 2], []], mode="ar", max_new_tokens=4)
    with pytest.raises(UserError, match="context window is 512: shorten the prompt to at most 412"):
        generate(target, [1] * 450, mode="ar", max_new_tokens=100)
    with pytest.raises(UserError, match="context window of 512 positions .*lower max_new_tokens to at most 511"):
        generate(target, [1, 2], mode="ar", max_new_tokens=600)
    with pytest.raises(UserError, match="token ids must be integers, got 1.5"):
        generate(target, [1.5, 2.5], mode="ar", max_new_tokens=2)
    with pytest.raises(UserError, match="token ids must be integers"):
        generate(target, [[1, 2], [3.0, 4]], mode="ar", max_new_tokens=2)
    with pytest.raises(UserError, match="top_k must be an integer in"):
        generate(target, [1, 2], mode="ar", max_new_tokens=2, temperature=1.0, top_k=2**40)
    with pytest.raises(UserError, match="seed must be an integer in"):
        generate(target, [1, 2], mode="ar", max_new_tokens=2, seed=1e23)
    with pytest.raises(UserError, match="seed must be an integer"):
        generate(target, [1, 2], mode="ar", max_new_tokens=2, seed=0.5)
    with pytest.raises(UserError, match="max_new_tokens"):
        generate(target, [1, 2], mode="ar", max_new_tokens=0)
    with pytest.raises(UserError, match="outside the target's vocabulary"):
        generate(target, [1, 128], mode="ar", max_new_tokens=2)
    with pytest.raises(UserError, match="no tokenizer"):
        generate(target, "text needs a tokenizer", mode="ar", max_new_tokens=2)
    with pytest.raises(UserError, match="unknown mode"):
        generate(target, [1, 2], mode="beam", max_new_tokens=2)
    with pytest.raises(UserError, match="needs a draft"):
        generate(target, [1, 2], mode="longspec", max_new_tokens=2)


def test_bucket_lengths():
    sizes = (1, 16, 17, 200, 256, 257, 320, 321, 2049, 2600, 4000, 4097, 8192)
    assert [bucket_length(n) for n in sizes] == [16, 16, 32, 256, 256, 320, 320, 384, 2560, 3072, 4096, 5120, 8192]
    for n in range(1, 9000, 7):  # never shorter, padding under 25 % past the small buckets
        assert n <= bucket_length(n) and (n <= 256 or bucket_length(n) < 1.25 * n + 1)


def test_fetch_reads_a_tree_back_in_one_copy_as_device_get_does():
    from longspec_jax.decode_kit import fetch

    tree = {
        "out": jnp.arange(12, dtype=jnp.int32).reshape(3, 4) - 5,
        "done": jnp.asarray([True, False, True]),
        "rounds": jnp.asarray(7, jnp.int32),
        "estimates": jnp.asarray([1.5, -0.0, jnp.inf, jnp.nan, 3e-39], jnp.float32),  # a subnormal too
        "none": None,
    }
    got, want = fetch(tree), jax.device_get(tree)
    assert got["none"] is None
    for name in ("out", "done", "rounds", "estimates"):
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        np.testing.assert_array_equal(got[name], want[name])
    assert np.signbit(got["estimates"][1])  # bit for bit, not value for value
    with pytest.raises(TypeError, match="int32, float32 and bool"):
        fetch(jnp.zeros((2,), jnp.bfloat16))


def test_forget_compiled_drops_every_program_kept():
    jitted = jax.jit(lambda x: x * 2 + 1)
    x = jnp.ones((3,), jnp.float32)
    program, seconds = decode_kit.compiled(jitted, x)
    assert seconds > 0 and decode_kit.compiled(jitted, x) == (program, 0.0)  # kept: no second compile
    np.testing.assert_array_equal(jitted(x), 3.0)
    assert jitted._cache_size() == 1
    decode_kit.forget_compiled()
    assert jitted._cache_size() == 0  # JAX's own cache too
    again, seconds = decode_kit.compiled(jitted, x)
    assert again is not program and seconds > 0
    np.testing.assert_array_equal(again(x), 3.0)


def _bytes_held(obj) -> int:
    """Bytes of the distinct arrays held by the nnx Modules among obj's attributes."""
    arrays = {}
    for value in vars(obj).values():
        if isinstance(value, nnx.Module):
            arrays.update((id(x), x) for x in jax.tree.leaves(nnx.state(value)))
    return sum(x.nbytes for x in arrays.values())


def test_a_generator_leaves_the_target_holding_its_weights_once():
    """Decoding packs the weights into the inference layout; the target then lets go of the layout it
    was loaded in (a 7B target in both layouts needs twice its weights' memory)."""
    target = random_target(tiny_config(), seed=5, dtype="float32")
    loaded = _bytes_held(target)
    matrices = [weakref.ref(layer.self_attn.q_proj.kernel[...]) for layer in target.model.layers]
    prompt = [3, 1, 4, 1, 5, 9]
    before = generate(target, prompt, mode="ar", max_new_tokens=5, eos_token_ids=()).tokens
    packed = target.decode_model()
    assert target.model is packed and hasattr(packed.layers[0].self_attn, "qkv_proj")
    gc.collect()
    assert all(ref() is None for ref in matrices)  # the loaded layout's arrays are gone
    assert _bytes_held(target) <= loaded  # the norms' weights folded away; no second copy of any matrix
    assert Generator(target, mode="ar").generate(prompt, max_new_tokens=5, eos_token_ids=()).tokens == before
    assert target.decode_model() is packed  # kept, not rebuilt
    loaded_again = random_target(tiny_config(), seed=5, dtype="float32")
    tokens = jnp.asarray([prompt])
    np.testing.assert_allclose(  # the forward and the draft's training input still run, now packed
        np.asarray(target.forward_logits(tokens)), np.asarray(loaded_again.forward_logits(tokens)), rtol=1e-5, atol=1e-5
    )
    positions = jnp.arange(len(prompt))[None]
    for got, want in zip(
        target.model.last_layer_kv(tokens, positions), loaded_again.model.last_layer_kv(tokens, positions)
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_cache_is_a_power_of_two_where_it_fits_roomily_else_whole_tiles():
    from longspec_jax.decode_kit import CACHE_ROW_TILE, plan_lengths

    assert plan_lengths(5000, 256, slack=64) == (5120, 256, 8192)  # free memory unknown (a CPU): roomy
    row = 1 << 20
    assert plan_lengths(5000, 256, slack=64, row_bytes=row, free_bytes=12 * 8192 * row)[2] == 8192
    _, _, rows = plan_lengths(5000, 256, slack=64, row_bytes=row, free_bytes=8192 * row)  # 8192 rows > 75 %
    assert rows % CACHE_ROW_TILE == 0 and 5120 + 256 + 64 <= rows < 5440 + CACHE_ROW_TILE
    with pytest.raises(UserError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        plan_lengths(5000, 256, slack=64, row_bytes=row, free_bytes=5000 * row)


def test_a_tight_cache_decodes_what_a_roomy_one_does(target, monkeypatch):
    """Where the device has too little room for a power-of-two cache, the request runs in whole
    128-row tiles and decodes the same tokens; one that cannot fit at all is refused, naming the fix."""
    from longspec_jax import generation

    prompt = [1 + i % 100 for i in range(299)]  # 299 tokens: a 320-token bucket, a 512-row roomy cache (AR, 16 new)
    roomy = generate(target, prompt, mode="ar", max_new_tokens=16, eos_token_ids=())
    row = 2 * target.config.num_layers * target.config.num_kv_heads * target.config.head_dim * 4
    monkeypatch.setattr(generation, "device_free_bytes", lambda: 600 * row)
    tight = generate(target, prompt, mode="ar", max_new_tokens=16, eos_token_ids=())
    assert tight.tokens == roomy.tokens
    assert tight.stats.target_cache_bytes < roomy.stats.target_cache_bytes == 512 * row + 4
    monkeypatch.setattr(generation, "device_free_bytes", lambda: 300 * row)
    with pytest.raises(UserError, match="shorten the prompt"):
        generate(target, prompt, mode="ar", max_new_tokens=16, eos_token_ids=())


def test_a_generator_tells_the_cache_rows_a_request_will_run_with(target, monkeypatch):
    """`Generator.cache_rows` (what the benchmark groups its warm-ups by) is the cache the request
    then gets, roomy or tight."""
    from longspec_jax import generation

    prompt = [1 + i % 100 for i in range(299)]
    row = 2 * target.config.num_layers * target.config.num_kv_heads * target.config.head_dim * 4
    gen = Generator(target, mode="ar")
    for free_rows, rows in ((None, 512), (600, 384)):
        monkeypatch.setattr(generation, "device_free_bytes", lambda f=free_rows: None if f is None else f * row)
        assert gen.cache_rows(len(prompt), 1, max_new_tokens=16) == rows
        result = gen.generate(prompt, max_new_tokens=16, eos_token_ids=())
        assert result.stats.target_cache_bytes == rows * row + 4
