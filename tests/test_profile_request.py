"""benchmarks/profile_request.py's idle gaps between a trace's kernels."""

from benchmarks.profile_request import gaps


def test_gaps_are_the_idle_time_between_kernels_longest_first():
    kernels = [
        {"ts": 0.0, "dur": 10.0, "name": "a"},
        {"ts": 15.0, "dur": 5.0, "name": "b"},  # 5 us after a: too short to list
        {"ts": 60.0, "dur": 10.0, "name": "c"},  # 40 us after b
        {"ts": 95.0, "dur": 1.0, "name": "d"},  # 25 us after c
        {"ts": 96.0, "dur": 1.0, "name": "e"},  # back to back
    ]
    assert gaps(kernels) == [(40.0, "b", "c"), (25.0, "c", "d")]
    assert gaps(kernels, at_least_us=30.0) == [(40.0, "b", "c")]
    assert gaps(kernels[:1]) == []
