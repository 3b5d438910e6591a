"""Other systems on the benchmarks' workloads: `python -m benchmarks.baselines.deepspeed_zero3 --smoke`."""
