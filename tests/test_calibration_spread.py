"""benchmarks/calibration_spread.py on a tiny model: every candidate calibrated each time, timed
as a fixed mode at two lengths, and AR and the smallest tree after idle gaps."""

from benchmarks import calibration_spread
from longspec_jax import calibration
from longspec_jax.adaptive import candidate_plan


def test_every_candidate_is_calibrated_each_time_and_timed_as_a_fixed_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "spread.json"
    report = calibration_spread.main(["--small", "--times", "2", "--repeats", "1", "--json-out", str(out)])
    plan = dict(candidate_plan(True, True, 1))
    assert list(report["candidates"]) == list(plan)
    for entry in report["candidates"].values():
        assert len(entry["calibrated_ms"]) == 2
        assert all(0 < ms < 1e3 * calibration.UNMEASURED_SECONDS for ms in entry["calibrated_ms"])
        assert entry["rounds"][0] < entry["rounds"][1]  # the longer request ran more rounds
    smallest = min((name for name in plan if name.startswith("tree")), key=lambda name: sum(plan[name]))
    assert set(report["idle"]) == {"ar", smallest}
    assert all(len(gaps) == len(calibration_spread.IDLE_GAPS_S) for gaps in report["idle"].values())
    assert out.is_file()
    # Only the untimed first request's calibration is on disk: the measured ones kept nothing.
    assert len(list((tmp_path / "cache").glob("calibration/*.json"))) == 1
