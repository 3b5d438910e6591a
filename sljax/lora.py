"""LoRA fine-tuning, layer-major: a frozen base whose layers stream from pinned host memory (or stay on the device)
as the generator's do, and small trainable adapters that keep fp32 master weights and optimizer state on the device.

One step (`LoraEngine.step`), top to bottom:

  embed every sub-batch                           (the frozen embeddings and head stay on the device)
  for each group g but the last: base W_g on the device (resident, or fetched from pinned host one group ahead);
      stash h[g][s]; every sub-batch through W_g + its adapters -> h[g+1][s]
  last group: forward + head + backward per sub-batch, residuals kept -> dh, the group's adapter gradient
  for each group g, last-but-one down to 0: W_g again (a streamed group crosses PCIe a second time); the stashed
      inputs back; recompute + backward of every sub-batch: input gradients and adapter gradients, none for the base
  one optax update of every adapter at once, on the device

The base has no master copy, no gradient and no optimizer state: it is held by the engine (`load_base` / `init_base`)
in the dtypes its layers run in and never changes, so the state a step consumes and returns (and a checkpoint holds)
is only the adapters, their optimizer state and the step count. Because the whole trainable state is on the device,
the update is the optimizer's own over all adapters at once: any optax chain, global-norm clipping included, is
exactly the plain step's.

Adapters (`LoraModel`) work on any layer-major model whose layers are Flax linen modules (models.common.
LayerMajorModel): each targeted `nn.Dense` of a layer gets two more params beside its kernel, lora_a [in, r] and
lora_b [r, out], and computes y = x W + (alpha / r) (x A) B. The models' code is untouched: a Flax method
interceptor adds the adapter term to each Dense that carries one.

A fine-tuning run (train.py --lora_rank) checkpoints the engine's state with a pointer to its base (`run_meta`);
generate.py --lora_checkpoint and sljax.lora_export read the adapters back and merge them into that base one layer
group at a time (`MergedWeights`), so the plain base model runs the fine-tuned one.
"""

import dataclasses
import json
import math
import os
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from models.common import check_model, layer_compute_dtypes, loss_denominator, params_reader
from models.config import ModelConfig
from models.hf import HFWeights
from models.presets import build
from sljax.checkpoint import newest_checkpoint, read_arrays
from sljax.generate import layer_groups
from sljax.machines import Budget, Machine, rates_of
from sljax.memory import InFlight, Placement, prefetch, tree_bytes
from sljax.plan import gpu_peak_from_cpu
from sljax.sizes import model_sizes

ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int = 16  # r: the adapters' inner width
  alpha: float = 16.0  # the adapter term is scaled by alpha / rank
  # Names of the Dense modules inside a layer that get adapters; () targets every one (all the projections).
  targets: tuple[str, ...] = ()

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
    if not math.isfinite(self.alpha) or self.alpha <= 0:
      raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def split_adapters(stacked) -> tuple[dict, dict]:
  """(base, adapters) of layer params that carry adapters: the adapters are the lora_a / lora_b leaves, each at its
  Dense's path; the base is everything else."""
  flat = traverse_util.flatten_dict(stacked)
  pick = lambda adapter: traverse_util.unflatten_dict({k: v for k, v in flat.items()
                                                       if (k[-1] in ADAPTER_LEAVES) == adapter})
  return pick(False), pick(True)


def join_adapters(base, adapters) -> dict:
  """Layer params with the adapters inserted beside the kernels they adapt (the inverse of split_adapters)."""
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base), **traverse_util.flatten_dict(adapters)})


class LoraModel:
  """`model` (a models.common.LayerMajorModel, or any model whose layers are linen modules applied inside its
  `layers` / `layers_cached`) with LoRA adapters in its layer params. The same contract as the model: params are
  {"outer", "layers"}, and "layers" holds the adapters beside the kernels (split_adapters takes them apart)."""

  def __init__(self, model, lora: LoraConfig):
    check_model(model)
    self.base, self.lora, self.cfg = model, lora, model.cfg

  def without_remat(self) -> "LoraModel":
    return LoraModel(self.base.without_remat(), self.lora)

  def _targeted(self, path: tuple) -> bool:
    return path[-1] == "kernel" and (not self.lora.targets or path[-2] in self.lora.targets)

  def init_adapters(self, key: jax.Array, base_layers) -> dict:
    """Adapters for stacked base layer params (arrays or shapes): lora_a uniform in +-1/sqrt(in) (as PEFT's default
    init), lora_b zeros, so a fresh adapter leaves the model unchanged. fp32 whatever the base's dtype."""
    kernels = {path: x for path, x in traverse_util.flatten_dict(base_layers).items() if self._targeted(path)}
    names = sorted({path[-2] for path in traverse_util.flatten_dict(base_layers) if path[-1] == "kernel"})
    unknown = [name for name in self.lora.targets if name not in names]  # a typo would silently adapt less
    if unknown or not kernels:
      raise ValueError(f"no Dense module of the layers is named {', '.join(unknown)} (LoRA targets "
                       f"{', '.join(self.lora.targets)}): the layers' are {', '.join(names)}")
    adapters = {}
    for key_i, (path, kernel) in zip(jax.random.split(key, len(kernels)), kernels.items()):
      layers, fan_in, fan_out = kernel.shape
      bound = 1 / math.sqrt(fan_in)
      adapters[(*path[:-1], "lora_a")] = jax.random.uniform(key_i, (layers, fan_in, self.lora.rank), jnp.float32,
                                                            -bound, bound)
      adapters[(*path[:-1], "lora_b")] = jnp.zeros((layers, self.lora.rank, fan_out), jnp.float32)
    return traverse_util.unflatten_dict(adapters)

  def _adapt(self, next_fun, args, kwargs, context):
    """Adds (alpha / r) (x A) B to the output of each Dense that carries adapters, in the Dense's compute dtype."""
    y = next_fun(*args, **kwargs)
    module = context.module
    if (isinstance(module, nn.Dense) and context.method_name == "__call__"
        and module.has_variable("params", "lora_a")):
      a, b = (module.get_variable("params", name).astype(y.dtype) for name in ADAPTER_LEAVES)
      y = y + (self.lora.scale * ((args[0].astype(y.dtype) @ a) @ b)).astype(y.dtype)
    return y

  # ---- the model contract: the base model's pieces, its layers with the adapters applied -------------------------

  def init_outer(self, key):
    return self.base.init_outer(key)

  def init_layers(self, keys):
    base = self.base.init_layers(keys)
    return join_adapters(base, self.init_adapters(jax.random.fold_in(keys[0], 1), base))

  def init(self, key):
    outer_key, layers_key = jax.random.split(key)
    return {"outer": self.init_outer(outer_key),
            "layers": self.init_layers(jax.random.split(layers_key, self.cfg.num_layers))}

  def embed(self, outer, tokens_BxS, positions_BxS=None):
    return self.base.embed(outer, tokens_BxS, positions_BxS)

  def layers(self, stacked, h_BxSxD):
    with nn.intercept_methods(self._adapt):
      return self.base.layers(stacked, h_BxSxD)

  def layers_cached(self, stacked, h_BxSxD, cache, offset, start_B):
    with nn.intercept_methods(self._adapt):
      return self.base.layers_cached(stacked, h_BxSxD, cache, offset, start_B)

  def init_cache(self, num_layers, batch, max_len):
    return self.base.init_cache(num_layers, batch, max_len)

  def head_loss(self, outer, h_BxSxD, targets_BxS, weights_BxS):
    return self.base.head_loss(outer, h_BxSxD, targets_BxS, weights_BxS)

  def logits(self, outer, h_BxSxD):
    return self.base.logits(outer, h_BxSxD)

  def loss(self, params, batch):
    """The weighted mean token loss, as models.common.LayerMajorModel.loss computes it (the plain step's)."""
    h = self.layers(params["layers"], self.embed(params["outer"], batch["inputs"]))
    total = self.head_loss(params["outer"], h, batch["targets"], batch["weights"])
    return total * (1 / loss_denominator(jnp.sum(batch["weights"])))

  def compute_dtypes(self, stacked):
    """The base's leaves in the dtypes the base model runs them in; adapters fp32 (cast inside each Dense)."""
    base, adapters = split_adapters(stacked)
    return join_adapters(layer_compute_dtypes(self.base, base), jax.tree.map(lambda x: jnp.dtype(x.dtype), adapters))


def merge(lora: LoraConfig, stacked) -> dict:
  """Layer params with each adapter folded into its kernel, W + (alpha / r) A B (in the kernel's dtype, computed in
  fp32): the base model's params, for export (models.hf) or for generating without the adapter term."""
  base, adapters = split_adapters(stacked)
  flat, updates = traverse_util.flatten_dict(base), traverse_util.flatten_dict(adapters)
  for path, a in updates.items():
    if path[-1] == "lora_a":
      kernel_path, b = (*path[:-1], "kernel"), updates[(*path[:-1], "lora_b")]
      kernel = flat[kernel_path]
      delta = lora.scale * jnp.einsum("lir,lro->lio", jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
      flat[kernel_path] = (jnp.asarray(kernel, jnp.float32) + delta).astype(kernel.dtype)
  return traverse_util.unflatten_dict(flat)


# ---- the engine ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LoraEngineConfig:
  sub_batches: int = 1  # N: the effective batch is split into N sub-batches that share each fetch of a base group
  live_layers: int = 1  # layers per group
  resident_layers: int = 0  # base layers that stay on the device (spread among the streamed ones); the rest stream
  activations_on_host: bool = True  # stash group-boundary hidden states in pinned host memory for the backward


def lora_flops_per_token(model: LoraModel, seq_len: int, recomputed_layers: int) -> float:
  """FLOPs per token of one LoRA step as the engine runs it, the figure its MFU counts: the base's matmuls forward
  and input-gradient (2 + 2 x params), once more forward for each recomputed layer, the adapters' (forward,
  recompute, input and adapter gradients), causal attention in the same passes (forward 2 S D per layer, backward
  twice that), and the head forward + input gradient. No weight gradient of the base is computed or counted."""
  sizes = model_sizes(model.base)
  cfg, layers = model.cfg, model.cfg.num_layers
  probe = jax.eval_shape(lambda: model.init_layers(jax.random.split(jax.random.key(0), 1)))
  base, adapters = split_adapters(probe)
  kernels = sum(x.size for path, x in traverse_util.flatten_dict(base).items() if path[-1] == "kernel")
  adapter_params = sum(x.size for x in jax.tree.leaves(adapters))
  attention = 2 * seq_len * sizes.hidden  # causal QK^T and AV of one forward
  passes = layers + recomputed_layers  # forwards run
  head = 4 * cfg.vocab_size * sizes.hidden if hasattr(cfg, "vocab_size") else 0
  return (2 * kernels * (passes + layers) + 2 * adapter_params * (passes + 2 * layers)
          + attention * (passes + 2 * layers) + head)


class LoraEngine:
  """Fine-tunes the adapters of `model` (a LoraModel) layer-major with `optimizer`, on one device.

    engine = LoraEngine(LoraModel(model, LoraConfig(rank=16)), optax.adamw(1e-4), LoraEngineConfig(...))
    engine.load_base(base_params)           # or init_base(key): {"outer", "layers"} of the base model, or a reader
    state = engine.init(key)                 # the adapters, their optimizer state, the step
    state, loss = engine.step(state, batch)  # consumes state
  """

  skips_bad_steps = True

  def __init__(self, model: LoraModel, optimizer: optax.GradientTransformation, cfg: LoraEngineConfig,
               placement: Placement | None = None):
    if getattr(model.cfg, "remat", False):
      model = model.without_remat()  # each group's backward already recomputes it
    num_layers = model.cfg.num_layers
    if cfg.sub_batches < 1 or cfg.live_layers < 1:
      raise ValueError(f"sub_batches and live_layers must be >= 1, got {cfg.sub_batches} and {cfg.live_layers}")
    if not 0 <= cfg.resident_layers <= num_layers:
      raise ValueError(f"resident_layers must be in 0..{num_layers}, got {cfg.resident_layers}")
    self.model, self.optimizer, self.cfg = model, optimizer, cfg
    self.place = placement or Placement.single()
    if self.place.mesh.size != 1:
      raise ValueError(f"LoRA fine-tuning runs on one device; the placement's mesh has {self.place.mesh.size}")
    self.groups, self.resident = layer_groups(num_layers, cfg.resident_layers, cfg.live_layers)
    self.base = None  # {"outer": on the device, "groups": [group g's base layers, on the device or pinned host]}
    probe = jax.eval_shape(lambda: model.base.init_layers(jax.random.split(jax.random.key(0), 1)))
    self.base_dtypes = layer_compute_dtypes(model.base, probe)
    layers = lambda base, adapters, x: model.layers(join_adapters(base, adapters), x)
    self._embed = jax.jit(model.embed)
    self._forward = jax.jit(layers)
    self._last_group = jax.jit(self._last_group_fn, donate_argnums=(3, 7))
    self._backward = jax.jit(self._backward_fn, donate_argnums=(2, 4))
    self._update = jax.jit(self._update_fn, donate_argnums=(0, 1))
    self._zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))
    self._cast = jax.jit(lambda stacked: jax.tree.map(lambda x, dtype: x.astype(dtype), stacked,
                                                      layer_compute_dtypes(model.base, stacked)))
    self._init_base_layers = jax.jit(lambda keys: self._cast(model.base.init_layers(keys)))
    self._init_outer = jax.jit(model.base.init_outer)

  # ---- jitted pieces -------------------------------------------------------------------------------------------

  def _last_group_fn(self, base, adapters, outer, x, targets, weights, inv_total, grads):
    def loss_fn(adapters, x):
      h = self.model.layers(join_adapters(base, adapters), x)
      return self.model.head_loss(outer, h, targets, weights) * inv_total

    loss, (d_adapters, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1))(adapters, x)
    return loss, dx, jax.tree.map(jnp.add, grads, d_adapters)

  def _backward_fn(self, base, adapters, x, dy, grads):
    _, vjp = jax.vjp(lambda adapters, x: self.model.layers(join_adapters(base, adapters), x), adapters, x)
    d_adapters, dx = vjp(dy)
    return dx, jax.tree.map(jnp.add, grads, d_adapters)

  def _update_fn(self, adapters, opt_state, grads, loss):
    """The optimizer's update of every adapter, or (a non-finite loss or gradient) the state unchanged."""
    ok = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
    updates, new_opt_state = self.optimizer.update(grads, opt_state, adapters)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    return keep(optax.apply_updates(adapters, updates), adapters), keep(new_opt_state, opt_state), ok

  # ---- the frozen base -----------------------------------------------------------------------------------------

  def _home(self, g: int, tree):
    return self.place.to_device(tree) if self.resident[g] else self.place.to_host(tree)

  def init_base(self, key: jax.Array):
    """A random base (the base model's init, one group at a time), for benchmarks."""
    outer_key, layers_key = jax.random.split(key)
    keys = jax.random.split(layers_key, self.model.cfg.num_layers)
    self.base = {"outer": self._init_outer(outer_key),
                 "groups": [self._home(g, self._init_base_layers(keys[a:b])) for g, (a, b) in enumerate(self.groups)]}

  def load_base(self, params):
    """The base from full base-model params ({"outer", "layers"}, numpy or jax) or a reader with outer() and
    layers(start, stop) (models.hf.HFWeights), read one group at a time straight to its home."""
    reader = params_reader(params)
    cast = lambda tree: jax.tree.map(lambda x, dtype: np.asarray(x).astype(dtype, copy=False), tree,
                                     layer_compute_dtypes(self.model.base, tree))
    self.base = {"outer": self.place.to_device(jax.tree.map(np.asarray, reader.outer())),
                 "groups": [self._home(g, cast(reader.layers(a, b))) for g, (a, b) in enumerate(self.groups)]}

  def base_params(self) -> dict:
    """The base as full-model params, numpy (for tests and export)."""
    layers = [jax.tree.map(np.asarray, group) for group in self.base["groups"]]
    return {"outer": jax.tree.map(np.asarray, self.base["outer"]),
            "layers": jax.tree.map(lambda *xs: np.concatenate(xs), *layers)}

  # ---- the trainable state -------------------------------------------------------------------------------------

  def init(self, key: jax.Array) -> dict:
    """Fresh adapters (LoraModel.init_adapters: the model starts as the base), their optimizer state, step 0."""
    shapes = jax.eval_shape(lambda: self.model.base.init_layers(jax.random.split(jax.random.key(0),
                                                                                  self.model.cfg.num_layers)))
    adapters = jax.jit(self.model.init_adapters)(key, shapes)
    return self.from_adapters(adapters)

  def from_adapters(self, adapters) -> dict:
    """State from adapters stacked over all layers (as LoraModel's params hold them)."""
    groups = [jax.tree.map(lambda x: jnp.asarray(x[a:b], jnp.float32), adapters) for a, b in self.groups]
    groups = self.place.to_device(groups)
    # Laid out as the step's outputs are (the optimizer's counters too, which a plain jit would leave unplaced):
    # otherwise the second step compiles the update again, a minute for llama70b's adapters on the GPU.
    return {"step": self.place.to_device(np.zeros((), np.int32)), "adapters": groups,
            "opt": jax.jit(self.optimizer.init, out_shardings=self.place.device())(groups)}

  def adapters(self, state: dict) -> dict:
    """The adapters stacked over all layers, numpy."""
    return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *state["adapters"])

  def abstract(self, key: jax.Array) -> dict:
    """Shapes, dtypes and shardings of `init(key)` (everything on the device), allocating nothing."""
    sharding = self.place.device()
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        jax.eval_shape(self.init, key))

  def settle(self, state: dict) -> dict:
    return state  # nothing is ever deferred: the update runs at the end of each step

  # ---- the step ------------------------------------------------------------------------------------------------

  def _fetch(self, g: int):
    """Group g's base layers on the device: a resident group's are there; a streamed group's cross PCIe."""
    group = self.base["groups"][g]
    return group if self.resident[g] else self.place.to_device(group)

  def _stash(self, x):
    return self.place.to_host(x) if self.cfg.activations_on_host else x

  def _unstash(self, x):
    return self.place.to_device(x) if self.cfg.activations_on_host else x

  def step(self, state: dict, batch: dict) -> tuple[dict, jax.Array]:
    """One optimizer step of the adapters on `batch` ({"inputs", "targets", "weights"}: [B, S] numpy, B = N x b).
    Returns (the new state, the loss: the weighted mean over the whole batch; NaN when the step was skipped for a
    non-finite loss or gradient, and then the state is unchanged). Consumes `state`."""
    if self.base is None:
      raise ValueError("the engine has no base: call load_base(params) or init_base(key) first")
    n = self.cfg.sub_batches
    rows = batch["inputs"].shape[0]
    if rows % n:
      raise ValueError(f"the batch's {rows} rows do not split into {n} sub-batches")
    tokens, targets, loss_weights = ([self.place.to_device(part) for part in np.split(np.asarray(batch[key]), n)]
                                     for key in ("inputs", "targets", "weights"))
    inv_total = np.float32(1) / loss_denominator(np.sum(np.asarray(batch["weights"], np.float32), dtype=np.float32))
    outer, adapters, last = self.base["outer"], state["adapters"], len(self.groups) - 1
    # The host stays one group ahead of the device (and starts a step once the last one is done), so the device
    # holds the streamed groups' weights (STREAMED_IN_FLIGHT) and the calls' buffers the plan counts, not those of
    # every group dispatched.
    jax.block_until_ready(state["step"])
    pace = InFlight(1)
    # Each streamed group crosses PCIe once forward and once backward; the last group's weights serve both.
    stream = prefetch([*range(last + 1), *range(last - 1, -1, -1)], self._fetch)

    level = [self._embed(outer, tokens[s]) for s in range(n)]
    boundaries = []
    for g in range(last):
      w = next(stream)
      boundaries.append([self._stash(x) for x in level])
      level = [self._forward(w, adapters[g], x) for x in level]
      pace.add(level[-1])

    w, grads = next(stream), [None] * (last + 1)
    acc, losses, cotangents = self._zeros(adapters[last]), [], []
    for s, x in enumerate(level):
      loss, dx, acc = self._last_group(w, adapters[last], outer, x, targets[s], loss_weights[s], inv_total, acc)
      losses.append(loss)
      cotangents.append(dx)
    pace.add(cotangents[-1])
    del level
    grads[last] = acc

    for g in range(last - 1, -1, -1):
      w, acc, dxs = next(stream), self._zeros(adapters[g]), []
      for x, dy in zip(prefetch(boundaries.pop(), self._unstash), cotangents):
        dx, acc = self._backward(w, adapters[g], x, dy, acc)
        dxs.append(dx)
      pace.add(dxs[-1])
      cotangents, grads[g] = dxs, acc
    del cotangents

    loss = sum(losses)
    new_adapters, new_opt, ok = self._update(adapters, state["opt"], grads, loss)
    return ({"step": state["step"] + ok.astype(jnp.int32), "adapters": new_adapters, "opt": new_opt},
            jnp.where(ok, loss, jnp.nan))


# ---- the plan -----------------------------------------------------------------------------------------------------

SUB_BATCH_TOKENS = 16384  # tokens per sub-batch call: enough for the matmuls to run at speed
# Device memory a GPU plan leaves unplanned: the llama70b run (benchmarks/results/lora_llama70b_h200.json) peaked
# 1.8 GiB above its plan (the allocator's own slack, compiled calls' buffers the analysis does not see).
GPU_MARGIN_BYTES = 4 * 2**30
# Streamed groups' weights on the device at once, as the step paces itself (one group ahead, sljax.memory.InFlight):
# the group whose calls may still be running (its buffers are freed once they have run), the next one, and the one
# after it, whose copy is issued as the next is taken.
STREAMED_IN_FLIGHT = 3
COMPUTE_MARGIN = 2.0  # each pass's compute must be this many times its copies (as sljax.plan asks)


class LoraPlan(NamedTuple):
  engine: LoraEngineConfig
  batch: int  # rows per step
  device_bytes: dict
  host_bytes: dict
  forward_seconds: float  # predicted compute of each pass, and its copies at the machine's copy rate
  forward_copy_seconds: float
  backward_seconds: float
  backward_copy_seconds: float

  @property
  def compute_bound(self) -> bool:
    return (self.forward_seconds >= COMPUTE_MARGIN * self.forward_copy_seconds
            and self.backward_seconds >= COMPUTE_MARGIN * self.backward_copy_seconds)

  def describe(self) -> str:
    tier = lambda parts: ", ".join(f"{k} {v / 2**30:.1f}" for k, v in parts.items() if v)
    e = self.engine
    stash = "in pinned host" if e.activations_on_host else "on the device"
    return "\n".join([
        f"LoRA plan: batch {self.batch} as {e.sub_batches} sub-batches, {e.resident_layers} base layers resident "
        f"(the rest stream), {e.live_layers} per group, activations {stash}",
        f"  device {sum(self.device_bytes.values()) / 2**30:.1f} GiB ({tier(self.device_bytes)})",
        f"  pinned host {sum(self.host_bytes.values()) / 2**30:.1f} GiB ({tier(self.host_bytes)})",
        f"  forward: compute {self.forward_seconds:.2f} s, copies {self.forward_copy_seconds:.2f} s; backward: compute "
        f"{self.backward_seconds:.2f} s, copies {self.backward_copy_seconds:.2f} s "
        f"({'compute-bound' if self.compute_bound else 'transfer-bound'})"])


_PEAKS: dict = {}  # compiled peaks by (model config, LoRA config, layers per group, rows, seq_len)


def _call_peak(model: LoraModel, live_layers: int, last_layers: int, rows: int, seq_len: int) -> int:
  """The larger of the last group's and a backward call's compiled temp + output bytes for one sub-batch of rows,
  as this process's backend compiles them."""
  key = (type(model.base), model.cfg, model.lora, live_layers, last_layers, rows, seq_len)
  if key not in _PEAKS:
    engine = LoraEngine(model, optax.sgd(0.0), LoraEngineConfig(live_layers=live_layers))
    shape = lambda *s, dtype=model.cfg.dtype: jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
    x = shape(rows, seq_len, model_sizes(model.base).hidden)

    def stacked(layers):
      base = jax.eval_shape(lambda: engine._cast(model.base.init_layers(jax.random.split(jax.random.key(0), layers))))
      return base, jax.eval_shape(model.init_adapters, jax.random.key(0), base)

    base, adapters = stacked(last_layers)
    outer = jax.eval_shape(model.base.init_outer, jax.random.key(0))
    calls = [engine._last_group.lower(base, adapters, outer, x, shape(rows, seq_len, dtype=jnp.int32),
                                      shape(rows, seq_len, dtype=jnp.float32), shape(dtype=jnp.float32), adapters)]
    if model.cfg.num_layers > last_layers:
      base, adapters = stacked(live_layers)
      calls.append(engine._backward.lower(base, adapters, x, x, adapters))
    _PEAKS[key] = max(a.temp_size_in_bytes + a.output_size_in_bytes
                      for a in (call.compile().memory_analysis() for call in calls))
  return _PEAKS[key]


def plan_lora(model: LoraModel, seq_len: int, budget: Budget, batch: int = 0, sub_batches: int = 0,
              live_layers: int = 1, max_rows: int = 256, optimizer: optax.GradientTransformation | None = None,
              target: Machine | None = None) -> LoraPlan:
  """How the engine runs on one device: sub-batches of about SUB_BATCH_TOKENS tokens; the group-boundary
  activations on the device when everything fits there, else in pinned host memory; as many base layers resident as
  the device holds beside the adapters' state, the activations and the compiled calls' peak (the rest stream from
  pinned host); and (batch 0) the fewest rows whose passes are compute-bound with a margin, else the most that fit.
  target: plan for one GPU of that machine (its rates; made on a CPU, the calls' compiled peak corrected by
  sljax.plan.gpu_peak_from_cpu, an estimate) instead of for this process's device. ValueError when nothing fits."""
  sizes = model_sizes(model.base)
  machine = target or rates_of(jax.devices()[0].device_kind)
  on_cpu = jax.devices()[0].platform == "cpu"
  peak_of = lambda rows: (gpu_peak_from_cpu if target and on_cpu else int)(
      _call_peak(model, live_layers, last_layers, rows, seq_len))
  optimizer = optimizer or optax.adamw(1e-4)
  layers, layer = sizes.num_layers, sizes.layer_weight_bytes
  adapters = split_adapters(jax.eval_shape(lambda: model.init_layers(jax.random.split(jax.random.key(0), layers))))[1]
  outer = jax.eval_shape(model.base.init_outer, jax.random.key(0))
  fixed = {"margin (unplanned)": GPU_MARGIN_BYTES if target or not on_cpu else 0,
           "embeddings+head (frozen)": tree_bytes(outer),
           # master, gradients, the new master; the optimizer state and its new value
           "adapters (master, grads, optimizer, update)":
               3 * tree_bytes(adapters) + 2 * tree_bytes(jax.eval_shape(optimizer.init, adapters))}
  groups = layer_groups(layers, 0, live_layers)[0]
  last_layers = groups[-1][1] - groups[-1][0]

  def layout(rows: int, n: int) -> LoraPlan | None:
    """The plan for rows in n sub-batches whose step copies the fewest bytes: the stash on the device costs base
    layers that must then stream (twice per step each), the stash in host memory costs its own copies out and in."""
    sub = rows // n
    act = sizes.activation_bytes(sub, seq_len)
    stash = (len(groups) - 1) * n * act  # every group's input but the last's
    peak = peak_of(sub)
    # One pass over the base: 2 FLOPs per parameter and token at the machine's layer efficiency. The backward runs
    # it twice (recompute, input gradients); each pass copies every streamed layer in, the stash crosses once each way.
    forward = rows * seq_len * 2 * sizes.layer_params * layers / (machine.peak_flops * machine.layer_efficiency)
    plans = []
    for on_host in (False, True):
      device = dict(fixed, **{"activations in flight": 3 * n * act, "largest call (compiled)": peak,
                              "stashed activations": 0 if on_host else stash})
      left = budget.device_bytes - sum(device.values())
      in_flight = STREAMED_IN_FLIGHT * live_layers * layer
      resident = layers if left >= layers * layer else int((left - in_flight) // layer)
      streamed = layers - resident
      host = {"streamed base layers": streamed * layer, "stashed activations": stash if on_host else 0}
      if resident < 0 or sum(host.values()) > budget.host_bytes:
        continue
      device["resident base layers"] = resident * layer
      device[f"streamed base groups ({STREAMED_IN_FLIGHT} in flight)"] = in_flight if streamed else 0
      copies = (streamed * layer / machine.copy_bytes_per_s
                + (stash / machine.copy_to_host_bytes_per_s if on_host else 0))
      plans.append(LoraPlan(LoraEngineConfig(n, live_layers, resident, on_host), rows, device, host,
                            forward_seconds=forward, forward_copy_seconds=copies, backward_seconds=2 * forward,
                            backward_copy_seconds=copies))
    return min(plans, key=lambda plan: plan.forward_copy_seconds, default=None)

  per_call = max(1, SUB_BATCH_TOKENS // seq_len)  # rows per sub-batch call
  # The fewest sub-batches whose rows stay within per_call (or the number given).
  split = lambda rows: sub_batches or min(d for d in range(1, rows + 1) if rows % d == 0 and rows // d <= per_call)
  if batch:
    if sub_batches and batch % sub_batches:
      raise ValueError(f"LoRA: batch {batch} does not split into {sub_batches} sub-batches")
    plan = layout(batch, split(batch))
    if plan is None:
      raise ValueError(f"LoRA: batch {batch} x {seq_len} tokens does not fit {budget.device_bytes / 2**30:.1f} GiB "
                       f"of device and {budget.host_bytes / 2**30:.1f} GiB of pinned host memory")
    return plan
  best = None
  step = sub_batches or per_call
  for rows in range(step, max_rows + 1, step):
    plan = layout(rows, split(rows))
    if plan is None:
      break
    best = plan
    if plan.compute_bound:
      break
  if best is None:
    raise ValueError(f"LoRA: not even {step} rows of {seq_len} tokens fit {budget.device_bytes / 2**30:.1f} GiB "
                     f"of device and {budget.host_bytes / 2**30:.1f} GiB of pinned host memory")
  return best


# ---- a fine-tuning run: the base its checkpoints point to, and the merged model they make --------------------------

# The peak learning rate train.py fine-tunes adapters at unless --learning_rate is given. The presets' recipes train
# every weight from scratch (llama-tiny's quick CPU run at 3e-3, LLaMA-2's 3e-4); adapters start as the identity on
# a trained base, and LoRA runs at about ten times full fine-tuning's rates: 2e-4 is the LoRA paper's for GPT-2
# (Hu et al. 2021) and QLoRA's for 7B and 13B LLaMA (Dettmers et al. 2023).
FINE_TUNING_LEARNING_RATE = 2e-4


def random_base_key(seed: int) -> jax.Array:
  """The key of a run's random base (`LoraEngine.init_base`) when the run is seeded `seed` (its adapters start from
  jax.random.key(seed), as every run's init does)."""
  return jax.random.fold_in(jax.random.key(seed), 1)


def run_meta(lora: LoraConfig, hf_dir: str, seed: int) -> dict:
  """What a fine-tuning run's checkpoints say of their adapters and of the frozen base they belong to, which is not
  saved: the LoRA config, and the base's Hugging Face directory (absolute) or the seed of a random base. JSON, as a
  checkpoint's metadata reads back."""
  base = {"hf_dir": os.path.abspath(hf_dir)} if hf_dir else {"random_seed": seed}
  return json.loads(json.dumps({**dataclasses.asdict(lora), "base": base}))


def describe_base(base: dict) -> str:
  return base["hf_dir"] if "hf_dir" in base else f"a random base of seed {base['random_seed']}"


class LoraCheckpoint(NamedTuple):
  """The newest checkpoint of a fine-tuning run, its arrays not read yet."""

  step_dir: str
  meta: dict  # the run's metadata (sljax.launch.train writes it): "model_config", "lora" (run_meta), ...
  lora: LoraConfig
  base: dict  # run_meta's: {"hf_dir": path} or {"random_seed": seed}


def open_checkpoint(directory: str) -> LoraCheckpoint:
  """The newest checkpoint under `directory` (a train.py --lora_rank run's workdir or its checkpoints/); ValueError
  (one line) when there is none or it holds no adapters."""
  step_dir, meta = newest_checkpoint(directory)
  entry = meta.get("lora")
  if not entry or "model_config" not in meta:
    raise ValueError(f"checkpoint {step_dir} holds no LoRA adapters: it was not written by train.py --lora_rank")
  return LoraCheckpoint(step_dir, meta, LoraConfig(entry["rank"], entry["alpha"], tuple(entry["targets"])),
                        entry["base"])


def read_adapters(checkpoint: LoraCheckpoint) -> dict:
  """The checkpoint's adapters stacked over all layers (as LoraModel's params hold them), numpy; nothing else of its
  state (the optimizer's) is read."""
  by_group = {}
  for path, value in read_arrays(checkpoint.step_dir, lambda path: path[0] == "adapters").items():
    by_group.setdefault(path[1], {})[path[2:]] = value
  groups = [traverse_util.unflatten_dict(by_group[g]) for g in sorted(by_group)]
  return jax.tree.map(lambda *xs: np.concatenate(xs), *groups)


class RandomBase:
  """The random base `LoraEngine.init_base(key)` makes, as a reader of the base model's params: outer() and
  layers(start, stop), numpy in the model's param dtype, made when read."""

  def __init__(self, model, key: jax.Array):
    outer_key, layers_key = jax.random.split(key)
    self.outer_key, self.layer_keys = outer_key, jax.random.split(layers_key, model.cfg.num_layers)
    self.init_outer, self.init_layers = jax.jit(model.init_outer), jax.jit(model.init_layers)

  def outer(self) -> dict:
    return jax.tree.map(np.asarray, self.init_outer(self.outer_key))

  def layers(self, start: int, stop: int) -> dict:
    return jax.tree.map(np.asarray, self.init_layers(self.layer_keys[start:stop]))


class MergedWeights:
  """A reader of the base model's params (`base`: params or a reader, e.g. models.hf.HFWeights) with `adapters`
  (stacked over all layers) folded into its kernels by `merge`, one group at a time as layers(start, stop) reads it:
  the plain base model then computes the fine-tuned one, at no cost per token."""

  def __init__(self, base, lora: LoraConfig, adapters: dict):
    self.base, self.lora, self.adapters = params_reader(base), lora, adapters

  def outer(self) -> dict:
    return self.base.outer()

  def layers(self, start: int, stop: int) -> dict:
    adapters = jax.tree.map(lambda x: x[start:stop], self.adapters)
    return jax.tree.map(np.asarray, merge(self.lora, join_adapters(self.base.layers(start, stop), adapters)))


def base_weights(checkpoint: LoraCheckpoint, cfg: ModelConfig, hf_dir: str | None = None):
  """A reader of the base the checkpoint's adapters were trained on, as `cfg` (the run's model config, its dtypes
  perhaps changed) describes it: the Hugging Face directory its metadata names (`hf_dir`: a copy of that base
  elsewhere), else the run's random base. ValueError (one line) when the directory is not there or holds another
  model."""
  where = hf_dir or checkpoint.base.get("hf_dir")
  if not where:
    return RandomBase(build(cfg), random_base_key(checkpoint.base["random_seed"]))
  try:
    return HFWeights(where, **dataclasses.asdict(cfg))  # every field the run's: its shapes are checked on the files
  except ValueError as error:
    base = f"the base of {checkpoint.step_dir}'s adapters"
    raise ValueError(f"{error}: --hf_dir must hold {base}" if hf_dir else
                     f"{error}: {base}, where its metadata says (--hf_dir: where it is now, if it moved)") from None
