"""sljax: SpeedLoader in JAX. Layer-major, sub-batched training and inference with host offload.

  engine = sljax.Engine(model, optax.adamw(3e-4), sljax.EngineConfig(sub_batches=4, live_layers=1))
  state = engine.init(jax.random.key(0))
  state, loss = engine.step(state, batch)  # batch: {"inputs", "targets", "weights"} [B, S] numpy arrays
"""

from sljax.memory import Placement
from sljax.plan import Budget, make_plan
from sljax.schedule import Engine, EngineConfig

__all__ = ["Budget", "Engine", "EngineConfig", "Placement", "make_plan"]
