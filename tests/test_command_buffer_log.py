"""benchmarks/command_buffer_log.py's count of XLA's command-buffer work per decode call, on log
lines in the form XLA writes them."""

from benchmarks.command_buffer_log import summarise

LOG = """\
I1202 23:35:00.41 531 cuda_command_buffer.cc:132] Create new CUDA graph
=== decode call longspec 0
I1202 23:35:00.49 531 cuda_command_buffer.cc:132] Create new CUDA graph
I1202 23:35:00.51 531 cuda_command_buffer.cc:973] Launch command buffer executable graph 0x1c57fc80 on a stream: 0x1
I1202 23:35:00.52 531 cuda_command_buffer.cc:973] Launch command buffer executable graph 0x1c57fc80 on a stream: 0x1
=== decode call longspec 0 rounds 2 runs 1 ms 3.25
=== decode call longspec 1
I1202 23:35:05.50 531 command_executor.cc:654] Skip updating command loop_add_fusion grid: [384, 1, 1]
I1202 23:35:05.50 531 cuda_command_buffer.cc:612] Set kernel node params 0x2 in graph executable 0x3; kernel: x
I1202 23:35:05.50 531 cuda_command_buffer.cc:612] Set kernel node params 0x4 in graph executable 0x3; kernel: y
I1202 23:35:05.51 531 command_executor.cc:669] Updated 3 commands in 168 \u03bcs (skipped 1 command updates)
I1202 23:35:05.51 531 cuda_command_buffer.cc:973] Launch command buffer executable graph 0x1d2c1230 on a stream: 0x1
=== decode call longspec 1 rounds 1 runs 1 ms 1.50
I1202 23:35:05.60 531 cuda_command_buffer.cc:973] Launch command buffer executable graph 0x1d2c1230 on a stream: 0x1
"""


def test_events_are_counted_per_call_and_nothing_outside_the_calls():
    first, second = summarise(LOG)
    assert first == {
        "call": "longspec 0",
        "rounds": 2,
        "runs": 1,
        "decode ms": 3.25,
        "graphs created": 1,
        "replays": 2,
        "nodes updated": 0,
        "nodes unchanged": 0,
        "update ms": 0.0,
    }
    assert second["call"] == "longspec 1" and second["rounds"] == 1
    assert (second["replays"], second["nodes updated"], second["nodes unchanged"]) == (1, 2, 1)
    assert second["update ms"] == 0.168


def test_an_unfinished_call_is_not_reported():
    assert summarise("=== decode call ar 0\nI1 1 x.cc:1] Launch command buffer executable graph 0x1\n") == []


def test_a_call_labelled_with_its_prompt_keeps_the_label():
    log = "=== decode call auto 2 p3\n=== decode call auto 2 p3 rounds 7 runs 2 ms 9.50\n"
    (call,) = summarise(log)
    assert call["call"] == "auto 2 p3" and (call["rounds"], call["runs"], call["decode ms"]) == (7, 2, 9.5)
