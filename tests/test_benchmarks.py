"""The benchmarks' smoke modes: each runs its code path on tiny shapes (their numbers come from the GPU), as a module
from the repository root, the way the docstrings say to run them (the training benchmarks' in
tests/test_benchmarks_training.py); and the result tables are the result files' own."""

import json
import os

import pytest

from benchmarks import results_tables

from helpers import REPO, benchmark_smoke, has_provenance


@pytest.mark.slow
def test_plan_vs_peak_smoke_measures_each_planners_cli_against_its_plan(tmp_path):
  """Training (offload, clipped), LoRA and generation, each as its CLI runs with --memory_peaks. On CPU the plans
  print 0.0 GiB tiers (tiny models at 0.1 GiB resolution), so whether they hold is for the GPU's file to say."""
  result = benchmark_smoke("plan_vs_peak", tmp_path)
  assert has_provenance(result, "plan_vs_peak")
  assert [row["case"] for row in result["results"]] == ["train_offload", "lora", "generate"]
  for row in result["results"]:
    assert "error" not in row, row
    assert row["peaks_bytes"]["device"] > 0 and row["device"]["measured_is"] == "live arrays (no allocator)"
    assert {"planned_gib", "measured_gib", "within_plan"} <= set(row["pinned_host"])


@pytest.mark.slow
def test_generate_py_run_smoke_runs_the_benchmarks_plan_through_the_cli(tmp_path):
  result = benchmark_smoke("generate_py_run", tmp_path)
  assert has_provenance(result, "generate_py_run")
  assert result["same_plan"] and result["cli_plan"].startswith("batch 4 = 2 sub-batches"), result["cli_plan"]
  assert [batch["rows"] for batch in result["cli_batches"]] == [4, 4]  # 8 prompts: two batches of the plan's 4
  assert result["cli_tokens_per_s_steady"] > 0 and result["benchmark_tokens_per_s"] > 0


@pytest.mark.slow
def test_generate_throughput_smoke_streams_and_counts_the_bytes(tmp_path):
  result = benchmark_smoke("generate_throughput", tmp_path, "--models=llama70b", "--streamed_bits=4",
                           "--weight_group_size=8")
  assert has_provenance(result, "generate_throughput")
  (run,) = result["results"]
  assert run["generation_tokens_per_s"] > 0 and run["counted_bytes_moved"]["host_to_device"] > 0
  assert run["config"]["plan"]["offload"]["kv_on_host"] and run["config"]["plan"]["offload"]["streamed_bits"] == 4
  assert "streamed int4 kernels" in run["weights"]


@pytest.mark.slow
def test_trace_overlap_smoke_finds_the_copies_hidden_by_compute_and_the_idle_gaps(tmp_path):
  result = benchmark_smoke("trace_overlap", tmp_path)
  assert result["copy_hidden_fraction"] == pytest.approx(60 / 80) and result["span_s"] == pytest.approx(400e-6)
  assert result["compute_fraction_of_span"] == pytest.approx(0.5) and result["idle_s"] == pytest.approx(200e-6)
  assert result["idle_gaps_over_100us"] == 1
  assert result["compute_threads"] == {"Stream #7(Compute)": pytest.approx(200e-6)}  # the copies' line is not compute
  assert result["compute_s_by_module"] == {"jit_update": pytest.approx(100e-6), "jit_layers": pytest.approx(100e-6)}
  assert result["idle_while_profiler_flushed_s"] == pytest.approx(60e-6)
  # The 50 us gap ends 30 us after the copy in ends (COPY_WAIT_US 50): the GPU waited for it; no copy ends in the
  # 150 us gap (the copy out ends 10 us before it begins).
  assert result["idle_waiting_for_copies_s"] == {"host_to_device": pytest.approx(50e-6), "device_to_host": 0.0}
  assert result["idle_gaps_waiting_for_copies"] == {"host_to_device": 1, "device_to_host": 0}
  windows = result["timeline"]  # 20 windows of 20 us
  assert [w["at_ms"] for w in windows] == pytest.approx([0.02 * i for i in range(20)])
  assert [w["compute"] for w in windows] == pytest.approx([1] * 5 + [0] * 2 + [0.5, 1, 1] + [0] * 7 + [0.5, 1, 1])
  assert windows[2]["host_to_device"] == pytest.approx(0.5) and windows[9]["device_to_host"] == pytest.approx(0.5)
  assert sum(w["host_to_device"] for w in windows) * 20e-6 == pytest.approx(result["busy_s"]["host_to_device"])
  no_copies = {"host_to_device": 0.0, "device_to_host": 0.0}
  assert result["largest_idle_gaps"] == [
      {"ms": pytest.approx(0.15), "at_ms": pytest.approx(0.2), "copies_ms": no_copies,
       "dispatch_thread_in": ["step", "PjitFunction(layers)", "cuLaunchHostFunc"],  # held in one dispatch
       "other_threads_ms": {"MemcpyH2D": pytest.approx(0.15), "BUFFER_FLUSH": pytest.approx(0.06)},
       "profiler_flush_ms": pytest.approx(0.06), "waited_for_copy": []},
      {"ms": pytest.approx(0.05), "at_ms": pytest.approx(0.1), "copies_ms": {"host_to_device": pytest.approx(0.02),
                                                                             "device_to_host": 0.0},
       "dispatch_thread_in": ["step"], "other_threads_ms": {"MemcpyH2D": pytest.approx(0.05)},  # thread free
       "profiler_flush_ms": 0.0, "waited_for_copy": ["host_to_device"]}]


@pytest.mark.slow
def test_checkpoint_scale_smoke_resumes_with_the_uninterrupted_losses(tmp_path):
  result = benchmark_smoke("checkpoint_scale", tmp_path, f"--workdir={tmp_path / 'checkpoints'}", "--tail_layers=2",
                           "--restore_readers=8")
  assert result["losses_equal"] and result["first_step_after_restore_equal"] and result["restored_step"] == 3
  assert result["engine"]["tail_layers"] == 2  # a tail group's state crosses the save and the restore too
  assert set(result["peak_host_extra_gib"]) == {"save", "restore"} and result["save_seconds"] > 0
  # The disk's own rates, on the checkpoint's file sizes, beside the checkpointer's.
  assert result["disk_rates"]["bytes"] == int(result["checkpoint_on_disk_gib"] * 2**30 + 0.5)
  assert result["disk_write_gb_per_s"] > 0 and result["disk_read_gb_per_s"] > 0
  assert result["save_fraction_of_disk"] == pytest.approx(result["save_gb_per_s"] / result["disk_write_gb_per_s"])
  # Where the time went, and a restore with more parts read at once.
  assert {"stage", "write", "checksum"} <= set(result["seconds_by_work"]["save"])
  assert {"read", "verify", "place", "wait for readers"} <= set(result["seconds_by_work"]["restore"])
  assert [run["readers"] for run in result["restore_readers_sweep"]] == [8]
  assert result["restore_readers_sweep"][0]["seconds"] > 0


@pytest.mark.slow
def test_checkpoint_kill_smoke_kills_a_save_and_the_same_command_resumes_with_its_losses(tmp_path):
  result = benchmark_smoke("checkpoint_kill", tmp_path, f"--workdir={tmp_path / 'work'}")
  kill, rerun = result["kill"], result["rerun"]
  assert kill["returncode"] == -9 and kill["during_save"] and "4.orbax-checkpoint-tmp" in kill["partial_directory"]
  assert kill["checkpoints_after_kill"][0] == "2" and len(kill["checkpoints_after_kill"]) == 2
  assert rerun["returncode"] == 0 and rerun["resumed_from"][0].endswith("at step 2")
  assert rerun["checkpoints_after"] == ["2", "4"]  # the half-written save is gone, step 4 saved whole
  assert result["steps_both_ran"] == [3, 4] and result["max_rel_diff"] <= 1e-6 and has_provenance(result, "checkpoint_kill")


@pytest.mark.slow
def test_export_scale_smoke_exports_a_run_and_transformers_gives_its_logits(tmp_path):
  result = benchmark_smoke("export_scale", tmp_path)
  assert result["logits_max_abs_diff"] <= 1e-5 and result["argmax_agreement"] == 1.0 and result["finite"]
  assert "model.safetensors.index.json" in result["files"] and result["model"]["num_hidden_layers"] == 3
  assert result["export_peak_rss_gib"] > 0 and result["transformers_forward"]["from_pretrained_seconds"] > 0
  assert has_provenance(result, "export_scale")


def test_pinned_pool_smoke_times_each_growth_and_a_pool_grown_first(tmp_path):
  result = benchmark_smoke("pinned_pool", tmp_path)
  assert has_provenance(result, "pinned_pool") and result["device"] and result["unit_bytes"] == 2**20
  assert [row["bytes"] for row in result["growth"]] == [2**20, 8 * 2**20, 32 * 2**20]
  assert all(row["first_s"] > 0 and row["again_s"] > 0 and row["resident_bytes"] > 0 for row in result["growth"])
  grown = result["grown_first"]
  assert grown["asked_bytes"] == grown["held_bytes"] == 64 * 2**20 and grown["grow_s"] > 0
  assert grown["buffer_bytes"] == 32 * 2**20 and grown["first_s"] > 0 and grown["again_s"] > 0


@pytest.mark.slow
def test_int4_matmul_smoke_times_every_variant_and_they_agree(tmp_path):
  result = benchmark_smoke("int4_matmul", tmp_path)
  assert has_provenance(result, "int4_matmul")
  (case,) = result["results"]
  assert set(case["ms"]) == {"bf16", "dequantize", "dot", "dequantize+dot", "fused_uint8", "fused_int4"}
  assert all(ms > 0 for ms in case["ms"].values())
  # The fused variants compute the stored weights exactly (the same products); bf16 is the uncompressed kernel.
  diff = case["max_abs_diff_vs_dequantize_dot"]
  assert diff["fused_uint8"] == diff["fused_int4"] == 0
  assert case["least_bytes"]["fused_int4"] < case["least_bytes"]["bf16"] / 3
  assert result["storage"]["int4_copy_ms"] > 0 and result["storage"]["uint8_pairs_copy_ms"] > 0
  layer = result["whole_layer"]
  assert layer["kernels"] == 7 and set(layer["ms"]) == {"one_call_int4", "one_call_uint8", "kernel_calls_int4",
                                                        "one_call_halves", "one_call_halves_xla", "stack_layer_in_place",
                                                        "stack_layer_sliced"}
  assert layer["halves_bit_equal"] == {"one_call_halves": True, "one_call_halves_xla": True,
                                       "stack_layer_in_place": True, "stack_layer_sliced": True}
  # The GPU kernel's block shapes (Pallas' interpreter here): each that divides the kernels agrees bit for bit
  blocks = layer["halves_blocks"]
  assert blocks["7x16"] is None and all(blocks[spec]["bit_equal"] and blocks[spec]["ms"] > 0
                                        for spec in ("8x16", "8x16x2"))


@pytest.mark.slow
def test_hf_accelerate_baseline_smoke(tmp_path):
  pytest.importorskip("accelerate", reason="accelerate is not in requirements.txt: the GPU machine's image has it")
  result = benchmark_smoke("baselines.hf_accelerate_generate", tmp_path)
  assert result["result"]["generation_tokens_per_s"] > 0


def test_the_peer_comparison_is_the_run_files_own():
  """benchmarks/results/generate_vs_peers_h200.json is what benchmarks.generate_vs_peers makes of the run files now."""
  from benchmarks import generate_vs_peers
  with open(os.path.join(REPO, "benchmarks", "results", "generate_vs_peers_h200.json")) as f:
    committed = json.load(f)["models"]
  assert committed == json.loads(json.dumps(generate_vs_peers.comparison()))


@pytest.mark.parametrize("name", sorted(results_tables.FILES))
def test_the_marked_result_tables_are_the_result_files_own(name):
  """Every file that holds marked tables (README.md, docs/results.md) holds exactly its own, each what
  benchmarks.results_tables makes from benchmarks/results/ now."""
  with open(os.path.join(REPO, name)) as f:
    text = f.read()
  assert sorted(results_tables.marked_tables(text)) == sorted(results_tables.FILES[name])
  assert results_tables.with_tables(text) == text, "run python -m benchmarks.results_tables --write"


def test_every_result_table_has_one_home():
  homes = [table for tables in results_tables.FILES.values() for table in tables]
  assert sorted(homes) == sorted(results_tables.TABLES)


def test_gpu_peak_calibration_smoke_gives_the_figures_of_sljax_plans_constants(tmp_path):
  """The smoke compiles llama-tiny's calls: the last group's figure is its outputs + one layer's residuals + the most
  scratch, the backward's its temp + outputs; the H200's file is for the reference shape sljax.plan's constants are
  for."""
  result = benchmark_smoke("gpu_peak_calibration", tmp_path)
  assert has_provenance(result, "gpu_peak_calibration") and result["model"] == "llama-tiny"
  (fwd_temp, _), (head_temp, _), (back_temp, _) = result["last_group_calls_temp_out"]
  assert 0 < result["residual_bytes"] < result["gpu_peak_bytes_equivalent"]
  assert result["gpu_peak_bytes_equivalent"] >= result["residual_bytes"] + max(fwd_temp, head_temp, back_temp)
  assert result["gpu_backward_peak_bytes_equivalent"] == sum(result["backward_temp_out"][0])
  from sljax import plan
  with open(os.path.join(REPO, "benchmarks/results/gpu_peak_calibration_h200.json")) as f:
    h200 = json.load(f)
  assert (h200["model"], h200["rows"], h200["seq"]) == (plan.GPU_PEAK_MODEL, plan.GPU_PEAK_ROWS, plan.GPU_PEAK_SEQ)
  assert h200["device"] == "NVIDIA H200" and h200["gpu_peak_bytes_equivalent"] > h200["residual_bytes"] > 0
