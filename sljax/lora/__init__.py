"""LoRA fine-tuning, layer-major: a frozen base whose layers stream from pinned host memory (or stay on the device)
as the generator's do, and small trainable adapters that keep fp32 master weights and optimizer state on the device.

  model.py       the adapters (LoraConfig, LoraModel) and `merge`, which folds them into their kernels
  engine.py      LoraEngine: one fine-tuning step, layer-major and sub-batched, on one device or data parallel
  plan.py        plan_lora: the engine's layout for a device and host budget (each device's, over a mesh)
  checkpoint.py  a run's checkpoints read back: their adapters, the base they point to, the merged model

Import the module you need: this package imports none of them, so that inference (generate.py, sljax.export)
reads a run's adapters through checkpoint.py without loading the training engine.
"""
