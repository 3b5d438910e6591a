"""A training step of each kind as sljax.trainer's loop takes it (StepFunctions): the plain all-on-device step and
whether its state fits, the SpeedLoader offload engine (sljax.schedule), the LoRA engine (sljax.lora.engine).
"""

import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from models.common import params_reader
from models.config import ModelConfig
from models.presets import build
from sljax import checkpoint_layout, schedule
from sljax.lora.checkpoint import random_base_key, restore_view
from sljax.lora.engine import LoraEngine, LoraEngineConfig
from sljax.lora.model import LoraConfig, LoraModel, split_adapters
from sljax.machines import GIB, available_ram_bytes
from sljax.memory import Placement, tree_bytes
from sljax.mesh import PER_DEVICE
from sljax.optim import OptimConfig, make_optimizer
from sljax.plan import optimizer_state_bytes
from sljax.schedule import EngineConfig


def training_state_bytes(model_cfg: ModelConfig, optim_cfg: OptimConfig) -> int:
  """Master weights, gradients and the optimizer's state; activations come on top."""
  params = jax.eval_shape(build(model_cfg).init, jax.random.key(0))
  return 2 * tree_bytes(params) + optimizer_state_bytes(make_optimizer(optim_cfg), params)


def memory_available(device: jax.Device) -> int | None:
  """Bytes a training state may use: the accelerator's allocator limit, or the host's available RAM on CPU; None
  when the platform does not say."""
  if device.platform == "cpu":
    return available_ram_bytes()
  return (device.memory_stats() or {}).get("bytes_limit")


def check_fits(model_name: str, model_cfg: ModelConfig, optim_cfg: OptimConfig, device: jax.Device):
  """Raises ValueError before anything is allocated when the all-on-device training state cannot fit."""
  needed, available = training_state_bytes(model_cfg, optim_cfg), memory_available(device)
  if available is not None and needed > available:
    raise ValueError(
        f"{model_name} ({model_cfg.param_count() / 1e9:.2f} B params) needs {needed / GIB:.1f} GiB for weights, "
        f"gradients and Adam moments, but {device.device_kind} {device.id} has {available / GIB:.1f} GiB; "
        f"train it with the offload engine (--engine=offload)")


class StepFunctions(NamedTuple):
  """A training step (sljax.trainer.Step) as functions: how all_on_device and offloaded hand one to the loop."""

  init: typing.Callable  # key -> state
  load: typing.Callable  # full-model params ({"outer", "layers"}) or a reader of them (models.hf.HFWeights) -> state
  step: typing.Callable  # (state, batch) -> (state, loss); may donate state
  abstract: typing.Callable  # key -> state of jax.ShapeDtypeStruct with shardings
  skips_bad_steps: bool
  settle: typing.Callable = lambda state: state  # state -> the state with its deferred updates applied
  # (state, batch) -> (the state settled, the loss of the batch on its params: model.loss), forward only; may donate
  # state as settle does
  evaluate: typing.Callable | None = None
  # A settled state -> what its checkpoint holds (a sljax.checkpoint.View, or the state itself: saved as it is), and
  # key -> what a restore places (a View, or None: the abstract state's arrays as they are).
  checkpoint: typing.Callable = lambda state: state
  checkpoint_target: typing.Callable = lambda key: None


class _DeviceCalls:
  """all_on_device's jitted calls of a model and optimizer, its state placed by `sharding`: init, load (params ->
  state), step (donates the state) and eval_loss."""

  def __init__(self, model, optimizer: optax.GradientTransformation, sharding):
    self.model, self.optimizer = model, optimizer
    self.init = jax.jit(self._init_fn, out_shardings=sharding)
    self.load = jax.jit(lambda params: {"params": params, "opt_state": optimizer.init(params)}, out_shardings=sharding)
    self.step = jax.jit(self._step_fn, donate_argnums=0)
    self.eval_loss = jax.jit(lambda state, batch: model.loss(state["params"], batch))

  def _init_fn(self, key):
    params = self.model.init(key)
    return {"params": params, "opt_state": self.optimizer.init(params)}

  def _step_fn(self, state, batch):
    loss, grads = jax.value_and_grad(self.model.loss)(state["params"], batch)
    updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
    keep_old = lambda new, old: jnp.where(finite, new, old)
    return jax.tree.map(keep_old, new_state, state), jnp.where(finite, loss, jnp.nan)


def all_on_device(model, optimizer: optax.GradientTransformation, device: jax.Device | None = None,
                  mesh: jax.sharding.Mesh | None = None) -> StepFunctions:
  """The whole model, its gradients and optimizer state on one device; one jitted call per step. With `mesh`: on
  every device of it, each taking its rows of the batch (data parallel; XLA all-reduces the gradient). The calls are
  shared by every step of the same model, optimizer and placement (another run of a config finds them compiled)."""
  sharding = (Placement(mesh).device() if mesh is not None
              else jax.sharding.SingleDeviceSharding(device or jax.devices()[0]))
  calls = schedule.shared_calls(("on device", model, optimizer, sharding), getattr(model, "cfg", None),
                                lambda: _DeviceCalls(model, optimizer, sharding))

  def load(params):
    reader = params_reader(params)  # the whole model fits on the device here, so it fits in host RAM too
    return calls.load(jax.device_put({"outer": reader.outer(), "layers": reader.layers(0, model.cfg.num_layers)},
                                     sharding))

  init, step, eval_loss = calls.init, calls.step, calls.eval_loss
  if mesh is not None:  # each device takes its rows of the batch
    place = Placement(mesh)
    step = lambda state, batch: calls.step(state, place.to_device(batch, PER_DEVICE))
    eval_loss = lambda state, batch: calls.eval_loss(state, place.to_device(batch, PER_DEVICE))
  abstract = lambda key: jax.eval_shape(init, key)
  return StepFunctions(init, load, step, abstract, skips_bad_steps=True,
                       evaluate=lambda state, batch: (state, eval_loss(state, batch)),
                       checkpoint=lambda state: checkpoint_layout.device_view(optimizer, state),
                       checkpoint_target=lambda key: checkpoint_layout.device_view(optimizer, abstract(key), True))


def offload_engine(model, optim_cfg: OptimConfig, engine_cfg: EngineConfig,
                   mesh: jax.sharding.Mesh | None = None) -> schedule.Engine:
  """The engine train.py runs for `optim_cfg` and the plan's `engine_cfg`: its AdamW without clipping, which the
  engine does itself (exactly, over all groups) at engine_cfg.grad_clip_norm, the plan's from optim_cfg."""
  return schedule.Engine(model, make_optimizer(optim_cfg, clip=False), engine_cfg,
                         None if mesh is None else Placement(mesh))


def offloaded(model, optim_cfg: OptimConfig, engine_cfg: EngineConfig,
              mesh: jax.sharding.Mesh | None = None) -> StepFunctions:
  """The SpeedLoader engine (sljax.schedule): layer-major, sub-batched, with host-resident state; over `mesh`, data
  parallel + FSDP."""
  engine = offload_engine(model, optim_cfg, engine_cfg, mesh)
  # A non-finite loss leaves its state unchanged; a non-finite gradient too when clipping (the updates then wait for
  # the global norm). Without clipping, updates stream out before the whole gradient is known: rewind instead.
  return StepFunctions(engine.init, engine.from_params, engine.step, engine.abstract_state,
                       skips_bad_steps=engine.cfg.grad_clip_norm > 0, settle=engine.settle,
                       evaluate=engine.evaluate,
                       checkpoint=lambda state: checkpoint_layout.offload_view(engine, state),
                       checkpoint_target=lambda key: checkpoint_layout.offload_view(
                           engine, engine.abstract_state(key), True))


def lora_engine(model_cfg: ModelConfig, optim_cfg: OptimConfig, lora: LoraConfig, engine_cfg: LoraEngineConfig,
                base, seed: int, mesh: jax.sharding.Mesh | None = None) -> LoraEngine:
  """The LoRA engine train.py runs (sljax.lora.engine): its AdamW and clipping over all adapters at once, on the frozen
  base `base` (full base-model params or a reader, models.hf.HFWeights, read one group at a time), or with None the
  random base of `seed`; data parallel over `mesh` when given."""
  engine = LoraEngine(LoraModel(build(model_cfg), lora), make_optimizer(optim_cfg), engine_cfg,
                      None if mesh is None else Placement(mesh))
  if base is None:
    engine.init_base(random_base_key(seed))
  else:
    engine.load_base(base)
  return engine


def fine_tuned(engine: LoraEngine, workdir: str) -> StepFunctions:
  """The LoRA engine as a training step: its state is the adapters, their optimizer state and the step; `load`
  takes LoraModel params (the base in them is not read: the engine holds its own). A checkpoint is the state as it
  is; the newest in `workdir` restores from either adapter layout (sljax.lora.checkpoint.restore_view)."""
  load = lambda params: engine.from_adapters(split_adapters(params["layers"])[1])
  return StepFunctions(engine.init, load, engine.step, engine.abstract, engine.skips_bad_steps, engine.settle,
                       evaluate=lambda state, batch: (state, engine.eval_loss(state, batch)),
                       checkpoint_target=lambda key: restore_view(workdir, engine.abstract(key)))


def make_step(model_cfg: ModelConfig, optim_cfg: OptimConfig, engine_cfg: EngineConfig | None,
              mesh: jax.sharding.Mesh | None = None) -> StepFunctions:
  """The offload engine's step with `engine_cfg`, else the plain all-on-device step; over `mesh` when given."""
  if engine_cfg is None:
    return all_on_device(build(model_cfg), make_optimizer(optim_cfg), jax.devices()[0], mesh)
  return offloaded(build(model_cfg), optim_cfg, engine_cfg, mesh)
