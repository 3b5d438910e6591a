"""sljax: SpeedLoader in JAX. Layer-major, sub-batched training and inference with host offload.

  engine = sljax.Engine(model, optax.adamw(3e-4), sljax.EngineConfig(sub_batches=4, live_layers=1))
  state = engine.init(jax.random.key(0))
  state, loss = engine.step(state, batch)  # batch: {"inputs", "targets", "weights"} [B, S] numpy arrays

  # LoRA: a frozen base (streamed where the device cannot hold it), trainable adapters on the device
  lora_model = sljax.LoraModel(model, sljax.LoraConfig(rank=16))  # model: a Flax layer-major one (models/)
  lora = sljax.LoraEngine(lora_model, optax.adamw(2e-4), sljax.LoraEngineConfig(sub_batches=4, resident_layers=40))
  lora.load_base(params)  # {"outer", "layers"} or a reader (models.hf.HFWeights); then init / step as above

The model is anything of the contract in models.common (TrainingModel; GenerationModel for sljax.generate);
examples/own_model.py writes one in plain jax.numpy. A step consumes its input state.

The names below are imported on first use, so that importing one module (sljax.generate, say) loads only what it
needs: inference never loads the training engine.
"""

import importlib

_HOMES = {"Budget": "sljax.machines", "Engine": "sljax.schedule", "EngineConfig": "sljax.schedule",
          "LoraConfig": "sljax.lora.model", "LoraEngine": "sljax.lora.engine", "LoraEngineConfig": "sljax.lora.engine",
          "LoraModel": "sljax.lora.model", "Placement": "sljax.memory", "default_budget": "sljax.machines",
          "make_plan": "sljax.plan", "model_sizes": "sljax.sizes", "plan_lora": "sljax.lora.plan"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
  if name not in _HOMES:
    raise AttributeError(f"module 'sljax' has no attribute {name!r}")
  return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__():
  return sorted(set(globals()) | set(__all__))
