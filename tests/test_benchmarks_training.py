"""The training benchmarks' smoke modes (throughput, scaling, kernel ceilings, train.py runs, resumes, LoRA and the
DeepSpeed/FSDP baseline): each runs its code path on tiny shapes, as a module from the repository root. Apart from
tests/test_benchmarks.py so that `--dist loadfile` gives the two halves of the benchmarks' time to two workers."""

import subprocess
import sys

import pytest

from benchmarks.common import TRAINING_SMOKE
from models.presets import get_config

from helpers import REPO, benchmark_smoke, has_provenance


@pytest.fixture(scope="module")
def train_throughput(tmp_path_factory) -> dict:
  """One smoke results file made as the GPU run makes it: the engine cases in one process (big traced), the model that
  fits in another, --merge collecting both."""
  tmp_path = tmp_path_factory.mktemp("train_throughput")
  benchmark_smoke("train_throughput", tmp_path, "--cases=big,big_like_deepspeed,big_clip,big_int8,llama7b", "--steps=1",
                  "--big_batch=2", "--big_sub_batches=2", "--big_int8_trade_state_for_tail")
  return benchmark_smoke("train_throughput", tmp_path, "--cases=fits", "--merge", "--steps=1",
                         "--fits_cases=device_remat,device_no_remat,engine,per_micro_batch")


def by_case(result: dict) -> dict:
  cases = [r["case"] for r in result["results"]]
  assert len(cases) == len(set(cases)), cases
  return {r["case"]: r for r in result["results"]}


@pytest.mark.slow
def test_train_throughput_smoke_runs_every_case_and_merges_the_runs(train_throughput):
  assert has_provenance(train_throughput, "train_throughput") and train_throughput["device"] == "cpu"
  cases = by_case(train_throughput)
  assert list(cases) == ["big", "big_like_deepspeed", "big_clip", "big_int8", "llama7b", "fits/device_remat",
                         "fits/device_no_remat", "fits/engine", "fits/per_micro_batch"]
  assert all(case["tokens_per_s"] > 0 and case["losses"][0] > 0 and 0 < case["mfu"] <= case["hfu"]
             for case in cases.values())
  # Each result says which run made it.
  assert "--cases=big,big_like_deepspeed" in cases["big"]["command"] and "--merge" in cases["fits/engine"]["command"]


@pytest.mark.slow
def test_train_throughput_smoke_runs_big_like_deepspeed_with_the_baselines_optimizer(train_throughput):
  """The case beside DeepSpeed: --big_batch rows in --big_sub_batches (in smoke too), clipped at 1.0, and the record
  of its optimizer in the DeepSpeed baseline's keys (vs_deepspeed compares the two)."""
  case = by_case(train_throughput)["big_like_deepspeed"]
  assert case["engine"]["grad_clip_norm"] == 1.0 and case["engine"]["sub_batches"] == 2
  assert case["plan"].startswith("sub-batches 2 x 1 rows")
  assert case["optimizer_settings"] == {
      "lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True,
      "grad_clip_norm": 1.0, "master_dtype": "float32", "moments_dtype": "float32", "grad_accum_dtype": "float32",
      "compute_dtype": "bfloat16"}


@pytest.mark.slow
def test_train_throughput_smoke_records_the_kernel_ceilings_beside_each_engine_step(train_throughput):
  for name in ("big", "big_clip", "big_int8", "llama7b", "fits/engine"):
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
  for name, preset in (("big_clip", "llama13b"), ("big_int8", "llama13b"), ("llama7b", "llama7b")):
    assert cases[name]["engine"]["grad_clip_norm"] == 1.0 and "clip 1," in cases[name]["optimizer"]
    # The smoke gives the batch (one row); on a GPU the plan chooses it.
    assert any(line.startswith(f"plan for {preset}, batch 1 x ") for line in cases[name]["launch_output"])
  assert "8-bit moments" in cases["big_int8"]["optimizer"] and "8-bit" not in cases["big_clip"]["optimizer"]


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
  assert done.returncode != 0
  assert "--cases: unknown bigg; choose from big, big_like_deepspeed, big_clip, big_int8, llama7b, fits" in done.stderr


@pytest.mark.slow
def test_train_scaling_smoke_runs_fsdp_over_two_devices(tmp_path):
  result = benchmark_smoke("train_scaling", tmp_path, "--cases=fsdp", "--steps=1")
  assert has_provenance(result, "train_scaling") and result["devices"] == 8
  (case,) = result["results"]
  assert case["mesh"] == {"data": 1, "fsdp": 2} and case["bytes_per_step"]["between_devices"] > 0


@pytest.mark.slow
def test_kernel_ceiling_smoke_times_the_three_kernels(tmp_path):
  result = benchmark_smoke("kernel_ceiling", tmp_path)
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
def test_resume_placement_smoke_resumes_another_engines_checkpoint_beside_the_uninterrupted_run(tmp_path):
  result = benchmark_smoke("resume_placement", tmp_path, "--steps=2", "--save_at=1")
  assert has_provenance(result, "resume_placement")
  uninterrupted, saved, resumed = result["runs"]
  assert [run["returncode"] for run in result["runs"]] == [0, 0, 0]
  assert sorted(saved["losses"]) == ["1"] and sorted(resumed["losses"]) == ["2"]
  assert "--engine=device" in resumed["command"] and any("resumed from" in note for note in resumed["notes"])
  assert resumed["max_rel_diff"] < 1e-4  # another engine's rounding (fp32: measured 2.9e-5)
  assert saved["max_rel_diff"] == 0.0


@pytest.mark.slow
def test_train_py_run_smoke_reads_the_plan_windows_and_every_loss(tmp_path):
  result = benchmark_smoke("train_py_run", tmp_path)
  assert result["returncode"] == 0 and result["plan"].startswith("plan for llama-tiny")
  assert result["command"].startswith("python train.py --model=llama-tiny") and result["versions"]["jax"]
  assert len(result["losses"]) == 12 and all(loss > 0 for loss in result["losses"])
  assert [w["last_step"] for w in result["windows"]] == [1, 4, 8, 12] and result["tokens_per_s_steady"] > 0
  assert (tmp_path / "result.log").read_text().count("loss ") > 0


def test_train_py_run_reads_the_progress_line_the_trainer_prints_and_older_ones_without_hfu():
  from benchmarks.train_py_run import summarize
  from sljax.metrics import progress_description
  bar = lambda step, line: f"{line}:  {100 * step // 3}%|##| {step}/3 [00:01<00:00]\r"
  lines = [(1, progress_description(3.0, 100.0, 0.1, 0.2)), (2, progress_description(2.0, 300.0, 0.3, 0.45)),
           (3, progress_description(1.0, 100.0, 0.1, 0.15, eval_loss=1.5))]
  result = summarize([], "".join(bar(step, line) for step, line in lines), [3.0, 2.0, 1.0], 1.0, 0)
  assert [(w["last_step"], w["mfu"], w["hfu"]) for w in result["windows"]] == [(1, 0.1, 0.2), (2, 0.3, 0.45),
                                                                              (3, 0.1, 0.15)]
  # Steady: windows 2-3, each weighted by its time (one step at 300 tok/s, one at 100).
  assert result["mfu_steady"] == pytest.approx((0.3 / 300 + 0.1 / 100) / (1 / 300 + 1 / 100))
  assert result["hfu_steady"] == pytest.approx((0.45 / 300 + 0.15 / 100) / (1 / 300 + 1 / 100))
  older = summarize([], "".join(bar(step, f"loss {step}.000 | 300 tok/s | MFU 30.0%") for step in (1, 2)), [1.0, 2.0],
                    1.0, 0)
  assert older["mfu_steady"] == pytest.approx(0.3) and older["hfu_steady"] is None


def test_train_py_run_reads_a_lora_plan():
  from benchmarks.train_py_run import summarize
  plan = ["plan for llama70b, batch 8 x 2048:", "LoRA plan: batch 8 as 1 sub-batches, 58 base layers resident",
          "  pinned host 35.1 GiB (streamed base layers 35.1)",
          "  forward: compute 3.24 s, copies 0.71 s; backward: compute 6.48 s, copies 0.71 s (compute-bound)"]
  result = summarize(["--lora_rank=16"], "\n".join(["note: a", *plan, "recipe of llama70b"]), [13.1], 1.0, 1)
  assert result["plan"] == "\n".join(plan) and result["goals"]["plan_compute_bound"] is True
  assert result["memory_peaks"] is None
  # Throughput goals by the command's kind: none on a bf16 base; QLoRA's 2,000 tok/s and 55% MFU; the full engine's 45%.
  assert set(result["goals"]) == {"plan_compute_bound", "no_loss_above_1.05x_first", "last_mean_below_first_mean"}
  bar = lambda step, tps, mfu: f"loss 1.000 | {tps} tok/s | MFU {mfu}% | HFU 60.0%:  50%|##| {step}/2 [00:01<00:00]\r"
  log = bar(1, "900", "30.0") + bar(2, "2,100", "54.0")
  qlora = summarize(["--lora_rank=16", "--base_bits=4"], log, [2.0, 1.0], 1.0, 0)["goals"]
  assert (qlora["tokens_per_s_steady_ge_2000"], qlora["mfu_steady_ge_0.55"]) == (True, False)
  assert summarize(["--model=llama13b"], log, [2.0, 1.0], 1.0, 0)["goals"]["mfu_steady_ge_0.45"] is True
  peaks = 'memory peaks: {"device": 3, "device_allocator": 5, "pinned_host": 2}'
  assert summarize([], "\n".join(["note: a", peaks, "done"]), [1.0], 1.0, 0)["memory_peaks"] == {
      "device": 3, "device_allocator": 5, "pinned_host": 2}


@pytest.mark.slow
def test_deepspeed_baseline_smoke_on_torch_fsdp(tmp_path):
  """The baseline's PyTorch FSDP2 backend needs only the CPU torch of requirements.txt."""
  result = benchmark_smoke("baselines.deepspeed_zero3", tmp_path, "--backend=fsdp_cpu_offload")
  assert result["status"] == "ok" and len(result["step_s"]) == 2 and result["versions"]["torch"]


@pytest.mark.slow
def test_deepspeed_baseline_smoke_on_deepspeed(tmp_path):
  pytest.importorskip("deepspeed", reason="DeepSpeed is installed only on the GPU machine (install_deepspeed.sh)")
  result = benchmark_smoke("baselines.deepspeed_zero3", tmp_path)
  assert result["status"] == "ok" and result["backend"] == "deepspeed"


@pytest.mark.slow
def test_vs_deepspeed_smoke_reports_both_systems_and_their_ratio(tmp_path):
  pytest.importorskip("deepspeed", reason="DeepSpeed is installed only on the GPU machine (install_deepspeed.sh)")
  result = benchmark_smoke("vs_deepspeed", tmp_path, "--models=fits")
  assert result["runs"]["fits"]["ratio_tokens_per_s"] > 0


def test_vs_deepspeed_sweeps_greedily_and_compares_the_points():
  from benchmarks.vs_deepspeed import greedy_sweep, parse_sweep, ratios
  knobs = parse_sweep("prefetch=2,3; overlap=false")
  assert knobs == [("prefetch", ["2", "3"]), ("overlap", ["false"])]
  rates = {(): 10.0, (("prefetch", "2"),): 12.0, (("prefetch", "3"),): None,  # a run that failed is not chosen
           (("overlap", "false"), ("prefetch", "2")): 11.0}
  best, trials = greedy_sweep(knobs, lambda settings: rates[tuple(sorted(settings.items()))])
  assert best == {"prefetch": "2"} and [t["tokens_per_s"] for t in trials] == [10.0, 12.0, None, 11.0]

  settings = {"lr": 1e-5, "grad_clip_norm": 1.0}
  report = {"points": {
      "1": {"sljax": {"status": "ok", "tokens_per_s": 300.0, "rows": 16, "optimizer_settings": settings},
            "deepspeed": {"status": "ok", "tokens_per_s": 100.0, "grad_accum": 1, "micro_batch": 16,
                          "optimizer_settings": {**settings, "grad_clip_norm": 0.0}}},
      "16": {"sljax": {"status": "ok", "tokens_per_s": 300.0, "rows": 256},
             "deepspeed": {"status": "failed"}}}}
  ratios(report)
  assert report["points"]["1"]["ratio_tokens_per_s"] == 3.0 and report["points"]["1"]["same_batch_rows"]
  assert report["points"]["16"]["ratio_tokens_per_s"] is None
  assert report["goal"] == {"accumulation": 16, "ratio_at_least": 5.0, "ratio": None, "met": None}
  assert report["settings"]["same"] is False
  assert report["settings"]["differences"] == {"grad_clip_norm": {"sljax": 1.0, "deepspeed": 0.0}}


@pytest.mark.slow
def test_vs_deepspeed_accumulation_smoke_split_over_two_runs(tmp_path):
  """The GPU run's split: the sweep and DeepSpeed's points in one call, sljax's in another merged onto it."""
  pytest.importorskip("deepspeed", reason="DeepSpeed is installed only on the GPU machine (install_deepspeed.sh)")
  first = benchmark_smoke("vs_deepspeed", tmp_path / "first", "--accumulation=1,2", "--parts=sweep,deepspeed",
                          "--sweep=overlap_comm=false")
  sweep = first["deepspeed_sweep"]
  assert [t["settings"] for t in sweep["trials"]] == [{}, {"overlap_comm": "false"}]
  assert all(t["tokens_per_s"] > 0 for t in sweep["trials"])
  run = first["deepspeed_runs"]["1,2"]
  assert run["one_update_per_optimizer_step"] and run["grad_accum_buffer_dtype"] == "float32"
  for accumulation, point in first["points"].items():
    deepspeed = point["deepspeed"]
    assert deepspeed["grad_accum"] == int(accumulation) and deepspeed["knobs"] == sweep["best"]
    assert len(deepspeed["micro_batch_s"][0]) == int(accumulation) and deepspeed["tokens_per_s"] > 0
  merged = tmp_path / "first" / "result.json"
  result = benchmark_smoke("vs_deepspeed", tmp_path / "second", "--accumulation=2", "--parts=sljax",
                           f"--merge={merged}")
  assert [call["command"].count("--parts=") for call in result["calls"]] == [1, 1]
  assert result["points"]["1"]["ratio_tokens_per_s"] is None  # DeepSpeed's alone
  point = result["points"]["2"]
  assert point["sljax"]["rows"] == 2 and point["same_batch_rows"] and point["ratio_tokens_per_s"] > 0
  assert result["settings"]["same"], result["settings"]


@pytest.mark.slow
def test_lora_benchmark_smoke_streams_part_of_the_base_and_resumes_exactly(tmp_path):
  (result,) = benchmark_smoke("lora_throughput", tmp_path, f"--workdir={tmp_path / 'checkpoint'}")["results"]
  assert 0 < result["plan"]["resident_layers"] < 8
  assert result["pcie_bytes_per_step"]["host_to_device"] > result["plan_host_bytes"]["streamed base layers"]
  assert result["checkpoint"]["equal"] and result["tokens_per_s"] > 0
  assert 0 < result["mfu"] < result["hfu"]  # 6 of its 8 layers recompute their forward: counted in HFU alone
