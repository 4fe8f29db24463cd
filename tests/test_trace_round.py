"""benchmarks/trace_round.py: its summary of a profiler trace (on hand-made traces), its options, and
that it traces a saved model's modes on an eval prompt (CPU)."""

import argparse
import gzip
import json

import pytest

from benchmarks import trace_round
from benchmarks.trace_round import kernel_class, summarise, top_kernels, with_graphs_while_profiling
from longspec_jax.draft_io import init_draft
from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.target import load_target
from tests.tiny_models import save_tiny_checkpoint, tiny_config


def trace(*kernels):
    """A Perfetto-style trace: a host thread and a GPU stream holding (name, start us, duration us)."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1000.0, "name": "python"},
    ]
    events += [{"ph": "X", "pid": 2, "tid": 7, "ts": ts, "dur": dur, "name": name} for name, ts, dur in kernels]
    return {"traceEvents": events}


def test_kernels_after_the_prefill_are_summed_by_class_per_round():
    t = trace(
        ("cudnn_generated_fort_native_sdpa", 0.0, 100.0),  # prefill: left out
        ("hybrid_split_k_attn_write", 200.0, 10.0),
        ("split_k_combine", 210.0, 6.0),
        ("void stream_executor::cuda::Run<16ul, float, unsigned int>", 216.0, 150.0),
        ("loop_add_fusion", 366.0, 4.0),
        ("hybrid_split_k_attn_write", 400.0, 10.0),
        ("split_k_combine", 410.0, 6.0),
        ("void stream_executor::cuda::Run<16ul, float, unsigned int>", 416.0, 150.0),
        ("loop_add_fusion", 566.0, 4.0),
    )
    s = summarise(t, rounds=2)
    assert s["Pallas attention"] == (1.0, pytest.approx(0.010))
    assert s["split-K combine"] == (1.0, pytest.approx(0.006))
    assert s["top-k, k = 16"] == (1.0, pytest.approx(0.150))
    assert s["other fusions"] == (1.0, pytest.approx(0.004))
    assert "cuDNN attention" not in s
    assert s["busy"] == (4.0, pytest.approx(0.170))
    assert s["span"][1] == pytest.approx((570.0 - 200.0) / 1e3 / 2)


def test_kernel_classes():
    assert kernel_class("gemm_fusion_dot_239") == "GEMM"
    assert kernel_class("nvjet_sm90_tst_128x160") == "GEMM"
    assert kernel_class("void stream_executor::cuda::Run<4ul, float, unsigned int>") == "top-k, other k"
    assert kernel_class("commit_rows") == "commit"
    assert kernel_class("entry_mosaic_gpu_kernel") == "Pallas attention"
    assert kernel_class("rotate_and_write_rows") == "rotate and write"
    assert kernel_class("input_reduce_fusion_144") == "other fusions"


def test_a_trace_without_gpu_kernels_is_refused():
    with pytest.raises(SystemExit, match="no GPU kernels"):
        summarise(trace(), rounds=1)


def test_a_cublas_gemm_inside_the_loop_is_counted_and_the_top_kernels_are_ranked_by_time():
    t = trace(
        ("nvjet_sm90_tss_prefill_gemm", 0.0, 50.0),
        ("cudnn_generated_fort_native_sdpa", 60.0, 100.0),  # the prefill ends here
        ("nvjet_sm90_tss_192x72", 200.0, 20.0),  # a GEMM of the loop itself
        ("gemm_fusion_dot_1", 220.0, 5.0),
        ("gemm_fusion_dot_1", 230.0, 5.0),
        ("nvjet_sm90_tss_192x72", 240.0, 20.0),
    )
    s = summarise(t, rounds=2)
    assert s["GEMM"] == (2.0, pytest.approx(0.025))
    top = top_kernels(t, rounds=2, n=2)
    assert [name for name, _, _ in top] == ["nvjet_sm90_tss_192x72", "gemm_fusion_dot_1"]
    assert top[0][1:] == (1.0, pytest.approx(0.020))
    assert top[1][1:] == (1.0, pytest.approx(0.005))


def test_the_trace_keeps_command_buffers_unless_the_flags_say_otherwise():
    assert with_graphs_while_profiling("") == "--xla_enable_command_buffers_during_profiling=true"
    assert with_graphs_while_profiling("--xla_gpu_enable_pdl=true").split() == [
        "--xla_gpu_enable_pdl=true",
        "--xla_enable_command_buffers_during_profiling=true",
    ]
    chosen = "--xla_enable_command_buffers_during_profiling=false"
    assert with_graphs_while_profiling(chosen) == chosen


def test_bad_mode_lists_and_auto_without_real_weights_are_refused():
    with pytest.raises(SystemExit, match="choose from longspec, ar, auto"):
        trace_round.main(["--modes", "ar,beam"])
    with pytest.raises(SystemExit, match="auto needs --target"):
        trace_round.main(["--modes", "auto"])
    with pytest.raises(SystemExit, match="needs --prompts"):
        trace_round.main(["--target", "some/checkpoint", "--modes", "ar"])


def test_a_saved_model_is_traced_in_each_mode_on_an_eval_prompt(tmp_path):
    """On the CPU the trace holds no GPU kernels to summarise; what is checked is that real weights,
    a saved draft and an eval prompt load, and that every mode, auto included, decodes under the
    profiler and leaves a trace beside its rounds."""
    target_dir = save_tiny_checkpoint(tmp_path / "target", tiny_config(), seed=3)
    draft_dir = init_draft(load_target(target_dir), seed=1).save(tmp_path / "draft")
    prompts = tmp_path / "set.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": list(range(5 + i, 45 + i))}) for i in range(2)) + "\n")
    args = argparse.Namespace(
        target=str(target_dir), draft=str(draft_dir), prompts=prompts, prompt_index=1, candidate_tokens=None
    )
    target, draft, prompt = trace_round.load(args)
    assert prompt == list(range(6, 46)) and draft is not None
    traces = trace_round.record(
        tmp_path / "traces", target, draft, prompt, ("auto", "ar", "longspec"), 12, (2, 2), temperature=1.0
    )
    assert list(traces) == ["auto", "ar", "longspec"]
    assert traces["ar"][1] == 11  # one token a round after the prefill's
    assert all(0 < rounds <= 11 for _, rounds in traces.values())
    for path, _ in traces.values():
        assert path.is_file() and path.name == "perfetto_trace.json.gz"


def test_without_a_target_random_weights_of_smollm2s_shape_load():
    args = argparse.Namespace(target=None, prompt_tokens=12, candidate_tokens=None)
    target, draft, prompt = trace_round.load(args)
    assert target.config == MODEL_SHAPES["smollm2_135m"] and draft is not None and len(prompt) == 12


def test_a_round_is_listed_from_the_kernel_after_one_commit_to_the_next():
    t = trace(
        ("cudnn_generated_fort_native_sdpa", 0.0, 100.0),
        ("head_top_k_tiles", 200.0, 50.0),
        ("commit_rows_in_cache", 250.0, 5.0),
        ("head_top_k_tiles", 300.0, 40.0),
        ("gemm_fusion_dot_1", 341.0, 20.0),
        ("commit_rows_in_cache", 361.0, 5.0),
    )
    first, second = trace_round.round_kernels(t, 0), trace_round.round_kernels(t, 1)
    assert [e["name"] for e in first] == ["head_top_k_tiles", "commit_rows_in_cache"]
    assert [(e["name"], e["dur"]) for e in second] == [
        ("head_top_k_tiles", 40.0),
        ("gemm_fusion_dot_1", 20.0),
        ("commit_rows_in_cache", 5.0),
    ]
    with pytest.raises(SystemExit, match="holds 2 rounds"):
        trace_round.round_kernels(t, 2)


def test_list_round_prints_the_rounds_kernels_with_their_gaps(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(
            trace(
                ("commit_rows_in_cache", 100.0, 5.0),
                ("gemm_fusion_dot_1", 107.0, 20.0),
                ("commit_rows_in_cache", 130.0, 5.0),
            ),
            f,
        )
    trace_round.main(["--summarise", str(path), "--rounds", "2", "--list-round", "1"])
    out = capsys.readouterr().out
    assert "20.0 us     2.0 us gap  gemm_fusion_dot_1" in out
    assert "round 1: 2 kernels, 0.025 ms busy" in out
