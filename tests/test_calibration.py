"""The calibration store: memory first, then disk, and a damaged file is measured again."""

from longspec_jax import calibration
from longspec_jax.calibration import calibration_key, forget_calibrations, load_calibration, save_calibration


def test_saved_calibration_survives_a_new_process_memory(tmp_path):
    key = calibration_key(target="t", batch=1, cache_rows=4096, candidates=("ar", "tree"))
    assert load_calibration(key, tmp_path) is None
    save_calibration(key, {"ar": 0.001, "tree": 0.0018}, tmp_path, batch=1)
    forget_calibrations()
    assert load_calibration(key, tmp_path) == {"ar": 0.001, "tree": 0.0018}


def test_keys_differ_by_what_the_cost_depends_on():
    base = dict(target="t", batch=1, cache_rows=4096, candidates=("ar", "tree"))
    keys = {
        calibration_key(**base),
        calibration_key(**{**base, "batch": 4}),
        calibration_key(**{**base, "cache_rows": 8192}),
    }
    assert len(keys) == 3
    assert calibration_key(**base) == calibration_key(**dict(reversed(list(base.items()))))


def test_costs_measured_by_other_library_code_are_not_reused(monkeypatch):
    """The key holds a hash of the library's and the kernels' sources: another version's costs
    (a faster kernel, another launch) are measured again."""
    base = dict(target="t", batch=1, cache_rows=4096, candidates=("ar", "tree"))
    assert calibration.library_fingerprint() == calibration.library_fingerprint()
    before = calibration_key(**base)
    monkeypatch.setattr(calibration, "library_fingerprint", lambda: "another version")
    assert calibration_key(**base) != before


def test_the_library_fingerprint_reads_the_kernels_sources(tmp_path, monkeypatch):
    import pallas_kernels

    copy = tmp_path / "pallas_kernels"
    copy.mkdir()
    (copy / "__init__.py").write_text("")
    (copy / "kernel.py").write_text("X = 1\n")
    monkeypatch.setattr(pallas_kernels, "__file__", str(copy / "__init__.py"))
    calibration.library_fingerprint.cache_clear()
    first = calibration.library_fingerprint()
    (copy / "kernel.py").write_text("X = 2\n")
    calibration.library_fingerprint.cache_clear()
    try:
        assert calibration.library_fingerprint() != first
    finally:
        calibration.library_fingerprint.cache_clear()


def test_a_damaged_or_unwritable_store_is_ignored(tmp_path):
    key = calibration_key(target="damaged")
    (tmp_path / f"{key}.json").write_text('{"seconds_per_round": {"ar": -1}}')
    assert load_calibration(key, tmp_path) is None
    (tmp_path / f"{key}.json").write_text("not json")
    assert load_calibration(key, tmp_path) is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    save_calibration(key, {"ar": 0.5}, blocker / "sub")  # cannot create a folder under a file: no error
    assert load_calibration(key, None) == {"ar": 0.5}  # still kept in memory
    forget_calibrations()


def test_measured_round_costs_leave_out_what_a_call_costs_besides_its_rounds():
    import jax.numpy as jnp
    import numpy as np
    from flax import struct

    from longspec_jax.calibration import measure_rounds

    @struct.dataclass
    class State:
        rounds: jnp.ndarray

    cost, overhead = [0.002, 0.005], 0.01  # a call costs 5x a round besides its rounds
    now = [0.0]  # a simulated clock: the test does not depend on how busy the machine is

    def run(state, rounds, candidate):
        now[0] += overhead + (rounds - int(state.rounds)) * cost[candidate]
        return State(jnp.asarray(rounds))

    state, seconds = measure_rounds(State(jnp.asarray(0)), run, 2, clock=lambda: now[0])
    np.testing.assert_allclose(seconds, cost, rtol=1e-9)
    one_call_per_run = (overhead + 2 * cost[0]) / 2  # what timing a single short run would have said
    assert one_call_per_run > 2 * cost[0]
    assert int(state.rounds) > 4  # the rounds ran are the generation's own


def test_a_misjudged_call_cost_moves_every_candidate_by_the_same_fraction():
    import jax.numpy as jnp
    import numpy as np
    from flax import struct

    from longspec_jax import calibration

    @struct.dataclass
    class State:
        rounds: jnp.ndarray

    cost, overhead = [0.001, 0.004], 0.003
    now, runs = [0.0], []

    def run(state, rounds, candidate):
        n = rounds - int(state.rounds)
        # A call that runs rounds costs more besides them than an empty call does (20 % here).
        now[0] += (overhead if n else 0.8 * overhead) + n * cost[candidate]
        runs.append((candidate, n))
        return State(jnp.asarray(rounds))

    _, seconds = calibration.measure_rounds(State(jnp.asarray(0)), run, 2, clock=lambda: now[0])
    timed = [max(n for c, n in runs if c == k) for k in range(2)]  # each candidate's longest call
    windows = [n * c for n, c in zip(timed, cost)]
    assert all(0.5 * calibration.TIMED_SECONDS <= w <= 1.5 * calibration.TIMED_SECONDS for w in windows)
    ratio = seconds[1] / seconds[0]
    assert abs(ratio / (cost[1] / cost[0]) - 1) < 0.05, seconds  # what the policy compares stays right
    assert np.all(seconds > cost)  # each alone is off by the misjudged 0.6 ms a call


def test_a_request_that_ends_early_keeps_what_it_measured_and_the_next_measures_the_rest(tmp_path, monkeypatch):
    import jax.numpy as jnp
    import numpy as np
    from flax import struct

    from longspec_jax import calibration

    @struct.dataclass
    class State:
        rounds: jnp.ndarray
        proposal: object = None

    cost, end = [0.001, 0.002, 0.004], [30]  # the request ends after `end` rounds
    now, measured = [0.0], []

    def run(state, rounds, candidate):
        rounds = min(rounds, end[0])
        now[0] += 0.003 + (rounds - int(state.rounds)) * cost[candidate]
        if rounds > int(state.rounds):
            measured.append(candidate)
        return State(jnp.asarray(rounds))

    real = calibration.measure_rounds
    monkeypatch.setattr(calibration, "calibration_folder", lambda: tmp_path)
    monkeypatch.setattr(calibration, "measure_rounds", lambda *a, **k: real(*a, **k, clock=lambda: now[0]))
    names = ("ar", "pld", "tree")
    state, seconds, source = calibration.calibrated(State(jnp.asarray(0)), run, names, "early")
    assert source == "measured" and set(measured) == {0, 1}  # the tree's turn came after the end
    np.testing.assert_allclose(seconds[:2], cost[:2], rtol=1e-6)
    assert seconds[2] == calibration.UNMEASURED_SECONDS
    calibration.forget_calibrations()
    measured.clear()
    end[0] = 1000
    state, seconds, source = calibration.calibrated(State(jnp.asarray(0)), run, names, "early")
    assert source == "measured" and set(measured) == {2}  # only what was missing
    np.testing.assert_allclose(seconds, cost, rtol=1e-6)
    measured.clear()
    state, seconds, source = calibration.calibrated(State(jnp.asarray(0)), run, names, "early")
    assert source == "kept" and measured == []
    calibration.forget_calibrations()


def test_an_expensive_candidate_is_priced_from_its_probe():
    import jax.numpy as jnp
    import numpy as np
    from flax import struct

    from longspec_jax import calibration

    @struct.dataclass
    class State:
        rounds: jnp.ndarray

    cost = [0.001, 0.05]  # a CPU: the tree's round costs 50x AR's, its probe 5x a timed run
    now, ran = [0.0], {0: 0, 1: 0}

    def run(state, rounds, candidate):
        n = rounds - int(state.rounds)
        now[0] += 0.002 + n * cost[candidate]
        ran[candidate] += n
        return State(jnp.asarray(rounds))

    _, seconds = calibration.measure_rounds(State(jnp.asarray(0)), run, 2, clock=lambda: now[0])
    np.testing.assert_allclose(seconds, cost, rtol=1e-9)
    assert ran[1] == 1 + calibration.PROBE_ROUNDS  # a warm-up round and the probe: no timed run
    assert ran[0] > 1 + calibration.PROBE_ROUNDS + 4  # the cheap one gets its timed run
