"""The benchmarks' smoke modes: each runs its code path on tiny shapes (their numbers come from the GPU), as a module
from the repository root, the way the docstrings say to run them."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import results_tables
from benchmarks.common import TRAINING_SMOKE
from models.presets import get_config

from helpers import REPO


def smoke(module: str, tmp_path, *args: str) -> dict:
  """Runs `python -m benchmarks.<module> --smoke --out=... args`; its results JSON."""
  out = tmp_path / "result.json"
  done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke", f"--out={out}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return json.loads(out.read_text())


def has_provenance(result: dict, module: str) -> bool:
  return (result["command"].startswith(f"python -m benchmarks.{module} --smoke") and result["date"]
          and result["versions"]["jax"] and "XLA_PYTHON_CLIENT_MEM_FRACTION" in result["env"])


@pytest.fixture(scope="module")
def train_throughput(tmp_path_factory) -> dict:
  """One smoke results file made as the GPU run makes it: the engine cases in one process (big traced), the model that
  fits in another, --merge collecting both."""
  tmp_path = tmp_path_factory.mktemp("train_throughput")
  smoke("train_throughput", tmp_path, "--cases=big,big_clip,llama7b", "--steps=1")
  return smoke("train_throughput", tmp_path, "--cases=fits", "--merge", "--steps=1",
               "--fits_cases=device_remat,device_no_remat,engine,per_micro_batch")


def by_case(result: dict) -> dict:
  cases = [r["case"] for r in result["results"]]
  assert len(cases) == len(set(cases)), cases
  return {r["case"]: r for r in result["results"]}


@pytest.mark.slow
def test_train_throughput_smoke_runs_every_case_and_merges_the_runs(train_throughput):
  assert has_provenance(train_throughput, "train_throughput") and train_throughput["device"] == "cpu"
  cases = by_case(train_throughput)
  assert list(cases) == ["big", "big_clip", "llama7b", "fits/device_remat", "fits/device_no_remat", "fits/engine",
                         "fits/per_micro_batch"]
  assert all(case["tokens_per_s"] > 0 and case["losses"][0] > 0 and 0 < case["mfu"] <= case["hfu"]
             for case in cases.values())
  # Each result says which run made it.
  assert "--cases=big,big_clip,llama7b" in cases["big"]["command"] and "--merge" in cases["fits/engine"]["command"]


@pytest.mark.slow
def test_train_throughput_smoke_records_the_kernel_ceilings_beside_each_engine_step(train_throughput):
  for name in ("big", "big_clip", "llama7b", "fits/engine"):
    case = by_case(train_throughput)[name]
    assert case["ceiling_mfu_full_recompute"] > 0 and case["ceiling_mfu_residuals_kept"] > 0
    assert case["ceiling_mfu_schedule_sustained"] > 0 and case["ceiling_mfu_full_recompute_sustained"] > 0
    kernels = case["kernel_ceiling"]  # at the step's shape: one row in smoke
    assert (kernels["rows"] * kernels["sub_batches"], kernels["seq_len"], kernels["live_layers"]) == (
        1, train_throughput["seq_len"], case["engine"]["live_layers"])
    assert kernels["sub_batches"] == case["engine"]["sub_batches"]


@pytest.mark.slow
def test_train_throughput_smoke_runs_big_clip_and_llama7b_as_train_py_would(train_throughput):
  cases = by_case(train_throughput)
  assert cases["big"]["engine"]["grad_clip_norm"] == 0
  for name, preset in (("big_clip", "llama13b"), ("llama7b", "llama7b")):
    assert cases[name]["engine"]["grad_clip_norm"] == 1.0 and "clip 1," in cases[name]["optimizer"]
    # The smoke gives the batch (one row); on a GPU the plan chooses it.
    assert any(line.startswith(f"plan for {preset}, batch 1 x ") for line in cases[name]["launch_output"])


@pytest.mark.slow
def test_train_throughput_smoke_traces_the_big_step(train_throughput):
  big = by_case(train_throughput)["big"]
  # A CPU's trace has no GPU lanes: read, but no busy fraction.
  assert big["trace"]["events"] > 0 and big["gpu_busy_fraction"] is None and big["traced_step_seconds"] > 0
  assert big["untraced_busy_fraction"] is None
  assert "trace" not in by_case(train_throughput)["big_clip"]


@pytest.mark.slow
def test_train_throughput_smoke_compares_the_engine_with_the_faster_device_step(train_throughput):
  cases, ratios = by_case(train_throughput), train_throughput["ratios"]
  assert cases["fits/device_remat"]["remat"] and not cases["fits/device_no_remat"]["remat"]
  best = max(("fits/device_remat", "fits/device_no_remat"), key=lambda name: cases[name]["tokens_per_s"])
  assert ratios["fits/best_device"] == best
  assert ratios["fits/engine_over_best_device"] == pytest.approx(
      cases["fits/engine"]["tokens_per_s"] / cases[best]["tokens_per_s"])
  assert ratios["engine_over_all_on_device"] == pytest.approx(
      cases["fits/engine"]["tokens_per_s"] / cases["fits/device_remat"]["tokens_per_s"])


@pytest.mark.slow
def test_train_throughput_names_an_unknown_case(tmp_path):
  done = subprocess.run([sys.executable, "-m", "benchmarks.train_throughput", "--smoke", "--cases=big,bigg"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode != 0 and "--cases: unknown bigg; choose from big, big_clip, llama7b, fits" in done.stderr


@pytest.mark.slow
@pytest.mark.slow
def test_plan_vs_peak_smoke_measures_each_planners_cli_against_its_plan(tmp_path):
  """Training (offload, clipped), LoRA and generation, each as its CLI runs with --memory_peaks. On CPU the plans
  print 0.0 GiB tiers (tiny models at 0.1 GiB resolution), so whether they hold is for the GPU's file to say."""
  result = smoke("plan_vs_peak", tmp_path)
  assert has_provenance(result, "plan_vs_peak")
  assert [row["case"] for row in result["results"]] == ["train_offload", "lora", "generate"]
  for row in result["results"]:
    assert "error" not in row, row
    assert row["peaks_bytes"]["device"] > 0 and row["device"]["measured_is"] == "live arrays (no allocator)"
    assert {"planned_gib", "measured_gib", "within_plan"} <= set(row["pinned_host"])


@pytest.mark.slow
def test_generate_py_run_smoke_runs_the_benchmarks_plan_through_the_cli(tmp_path):
  result = smoke("generate_py_run", tmp_path)
  assert has_provenance(result, "generate_py_run")
  assert result["same_plan"] and result["cli_plan"].startswith("batch 4 = 2 sub-batches"), result["cli_plan"]
  assert [batch["rows"] for batch in result["cli_batches"]] == [4, 4]  # 8 prompts: two batches of the plan's 4
  assert result["cli_tokens_per_s_steady"] > 0 and result["benchmark_tokens_per_s"] > 0


@pytest.mark.slow
def test_generate_throughput_smoke_streams_and_counts_the_bytes(tmp_path):
  result = smoke("generate_throughput", tmp_path, "--models=llama70b", "--streamed_bits=4", "--weight_group_size=8")
  assert has_provenance(result, "generate_throughput")
  (run,) = result["results"]
  assert run["generation_tokens_per_s"] > 0 and run["counted_bytes_moved"]["host_to_device"] > 0
  assert run["config"]["plan"]["offload"]["kv_on_host"] and run["config"]["plan"]["offload"]["streamed_bits"] == 4
  assert "streamed int4 kernels" in run["weights"]


@pytest.mark.slow
def test_train_scaling_smoke_runs_fsdp_over_two_devices(tmp_path):
  result = smoke("train_scaling", tmp_path, "--cases=fsdp", "--steps=1")
  assert has_provenance(result, "train_scaling") and result["devices"] == 8
  (case,) = result["results"]
  assert case["mesh"] == {"data": 1, "fsdp": 2} and case["bytes_per_step"]["between_devices"] > 0


@pytest.mark.slow
def test_trace_overlap_smoke_finds_the_copies_hidden_by_compute_and_the_idle_gaps(tmp_path):
  result = smoke("trace_overlap", tmp_path)
  assert result["copy_hidden_fraction"] == pytest.approx(60 / 80) and result["span_s"] == pytest.approx(400e-6)
  assert result["compute_fraction_of_span"] == pytest.approx(0.5) and result["idle_s"] == pytest.approx(200e-6)
  assert result["idle_gaps_over_100us"] == 1
  assert result["compute_threads"] == {"Stream #7(Compute)": pytest.approx(200e-6)}  # the copies' line is not compute
  assert result["compute_s_by_module"] == {"jit_update": pytest.approx(100e-6), "jit_layers": pytest.approx(100e-6)}
  assert result["idle_while_profiler_flushed_s"] == pytest.approx(60e-6)
  no_copies = {"host_to_device": 0.0, "device_to_host": 0.0}
  assert result["largest_idle_gaps"] == [
      {"ms": pytest.approx(0.15), "at_ms": pytest.approx(0.2), "copies_ms": no_copies,
       "dispatch_thread_in": ["step", "PjitFunction(layers)", "cuLaunchHostFunc"],  # held in one dispatch
       "other_threads_ms": {"MemcpyH2D": pytest.approx(0.15), "BUFFER_FLUSH": pytest.approx(0.06)},
       "profiler_flush_ms": pytest.approx(0.06)},
      {"ms": pytest.approx(0.05), "at_ms": pytest.approx(0.1), "copies_ms": {"host_to_device": pytest.approx(0.02),
                                                                             "device_to_host": 0.0},
       "dispatch_thread_in": ["step"], "other_threads_ms": {"MemcpyH2D": pytest.approx(0.05)},  # thread free
       "profiler_flush_ms": 0.0}]


@pytest.mark.slow
def test_kernel_ceiling_smoke_times_the_three_kernels(tmp_path):
  result = smoke("kernel_ceiling", tmp_path)
  assert has_provenance(result, "kernel_ceiling") and result["model"] == "llama13b"
  assert all(result[f"{kernel}_ms"] > 0 and len(result["ms_all"][kernel]) == result["repeats"]
             for kernel in ("forward", "recompute_backward", "residuals_kept"))
  # Four layers x four sub-batches of each kernel make the step, timed alone and back to back (sustained).
  for sustained in ("", "_sustained"):
    assert result[f"step_s_full_recompute{sustained}"] == pytest.approx(
        16e-3 * (result[f"forward_ms{sustained}"] + result[f"recompute_backward_ms{sustained}"]))
    assert result[f"step_s_residuals_kept{sustained}"] == pytest.approx(16e-3 * result[f"residuals_kept_ms{sustained}"])
  # The step's model FLOPs (the head's too, as the step's MFU counts them) over that time at the device's peak.
  cfg = get_config("llama13b", TRAINING_SMOKE)
  step_flops = result["rows"] * result["seq_len"] * result["sub_batches"] * cfg.flops_per_token(result["seq_len"])
  assert result["ceiling_mfu_full_recompute"] == pytest.approx(
      step_flops / (result["step_s_full_recompute"] * result["peak_flops"]))
  # The same time counted with the recomputed forward (CPU timings are too noisy to order the two steps).
  assert 0 < result["ceiling_mfu_full_recompute"] < result["ceiling_hfu_full_recompute"]
  assert result["ceiling_mfu_residuals_kept"] > 0


@pytest.mark.slow
def test_checkpoint_scale_smoke_resumes_with_the_uninterrupted_losses(tmp_path):
  result = smoke("checkpoint_scale", tmp_path, f"--workdir={tmp_path / 'checkpoints'}", "--tail_layers=2")
  assert result["losses_equal"] and result["first_step_after_restore_equal"] and result["restored_step"] == 3
  assert result["engine"]["tail_layers"] == 2  # a tail group's state crosses the save and the restore too
  assert set(result["peak_host_extra_gib"]) == {"save", "restore"} and result["save_seconds"] > 0
  # The disk's own rates, on the checkpoint's file sizes, beside the checkpointer's.
  assert result["disk_rates"]["bytes"] == int(result["checkpoint_on_disk_gib"] * 2**30 + 0.5)
  assert result["disk_write_gb_per_s"] > 0 and result["disk_read_gb_per_s"] > 0
  assert result["save_fraction_of_disk"] == pytest.approx(result["save_gb_per_s"] / result["disk_write_gb_per_s"])


@pytest.mark.slow
def test_resume_placement_smoke_resumes_another_engines_checkpoint_beside_the_uninterrupted_run(tmp_path):
  result = smoke("resume_placement", tmp_path, "--steps=2", "--save_at=1")
  assert has_provenance(result, "resume_placement")
  uninterrupted, saved, resumed = result["runs"]
  assert [run["returncode"] for run in result["runs"]] == [0, 0, 0]
  assert sorted(saved["losses"]) == ["1"] and sorted(resumed["losses"]) == ["2"]
  assert "--engine=device" in resumed["command"] and any("resumed from" in note for note in resumed["notes"])
  assert resumed["max_rel_diff"] < 1e-4  # another engine's rounding (fp32: measured 2.9e-5)
  assert saved["max_rel_diff"] == 0.0


@pytest.mark.slow
def test_train_py_run_smoke_reads_the_plan_windows_and_every_loss(tmp_path):
  result = smoke("train_py_run", tmp_path)
  assert result["returncode"] == 0 and result["plan"].startswith("plan for llama-tiny")
  assert result["command"].startswith("python train.py --model=llama-tiny") and result["versions"]["jax"]
  assert len(result["losses"]) == 12 and all(loss > 0 for loss in result["losses"])
  assert [w["last_step"] for w in result["windows"]] == [1, 4, 8, 12] and result["tokens_per_s_steady"] > 0
  assert (tmp_path / "result.log").read_text().count("loss ") > 0


@pytest.mark.slow
def test_int4_matmul_smoke_times_every_variant_and_they_agree(tmp_path):
  result = smoke("int4_matmul", tmp_path)
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
  assert layer["kernels"] == 7 and set(layer["ms"]) == {"one_call_int4", "one_call_uint8", "kernel_calls_int4"}


def test_train_py_run_reads_a_lora_plan():
  from benchmarks.train_py_run import summarize
  plan = ["plan for llama70b, batch 8 x 2048:", "LoRA plan: batch 8 as 1 sub-batches, 58 base layers resident",
          "  pinned host 35.1 GiB (streamed base layers 35.1)",
          "  forward: compute 3.24 s, copies 0.71 s; backward: compute 6.48 s, copies 0.71 s (compute-bound)"]
  result = summarize(["--lora_rank=16"], "\n".join(["note: a", *plan, "recipe of llama70b"]), [13.1], 1.0, 1)
  assert result["plan"] == "\n".join(plan) and result["goals"]["plan_compute_bound"] is True


@pytest.mark.slow
def test_deepspeed_baseline_smoke_on_torch_fsdp(tmp_path):
  """The baseline's PyTorch FSDP2 backend needs only the CPU torch of requirements.txt."""
  result = smoke("baselines.deepspeed_zero3", tmp_path, "--backend=fsdp_cpu_offload")
  assert result["status"] == "ok" and len(result["step_s"]) == 2 and result["versions"]["torch"]


@pytest.mark.slow
def test_deepspeed_baseline_smoke_on_deepspeed(tmp_path):
  pytest.importorskip("deepspeed", reason="DeepSpeed is installed only on the GPU machine (install_deepspeed.sh)")
  result = smoke("baselines.deepspeed_zero3", tmp_path)
  assert result["status"] == "ok" and result["backend"] == "deepspeed"


@pytest.mark.slow
def test_vs_deepspeed_smoke_reports_both_systems_and_their_ratio(tmp_path):
  pytest.importorskip("deepspeed", reason="DeepSpeed is installed only on the GPU machine (install_deepspeed.sh)")
  result = smoke("vs_deepspeed", tmp_path, "--models=fits")
  assert result["runs"]["fits"]["ratio_tokens_per_s"] > 0


@pytest.mark.slow
def test_hf_accelerate_baseline_smoke(tmp_path):
  pytest.importorskip("accelerate", reason="accelerate is not in requirements.txt: the GPU machine's image has it")
  result = smoke("baselines.hf_accelerate_generate", tmp_path)
  assert result["result"]["generation_tokens_per_s"] > 0


@pytest.mark.slow
def test_lora_benchmark_smoke_streams_part_of_the_base_and_resumes_exactly(tmp_path):
  (result,) = smoke("lora_throughput", tmp_path, f"--workdir={tmp_path / 'checkpoint'}")["results"]
  assert 0 < result["plan"]["resident_layers"] < 8
  assert result["pcie_bytes_per_step"]["host_to_device"] > result["plan_host_bytes"]["streamed base layers"]
  assert result["checkpoint"]["equal"] and result["tokens_per_s"] > 0


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
