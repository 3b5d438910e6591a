"""A model of your own under sljax: a GPT-2-style decoder in plain jax.numpy, trained, planned and generated.

Nothing here comes from models/: the model is dicts of arrays and functions (learned positions, LayerNorm, GELU, a
head tied to the token embedding), written to the contract in models.common (TrainingModel, GenerationModel):

  cfg                                   num_layers, dtype, param_dtype (and max_positions, for generation)
  init_outer(key), init_layers(keys_L)  params; layers stacked per key on a leading axis
  embed(outer, tokens_BxS[, positions_BxS]) -> h_BxSxD
  layers(stacked, h_BxSxD) -> h_BxSxD
  head_loss(outer, h_BxSxD, targets_BxS, weights_BxS) -> the weighted SUM of token losses
  init_cache, layers_cached, logits     generation

  python examples/own_model.py          trains 20 steps on random tokens, prints the plan and a generation
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import sljax  # noqa: E402
from sljax import generate_plan  # noqa: E402
from sljax.generate import OffloadedGenerator, SamplingConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 256
  hidden_size: int = 64
  num_heads: int = 4
  num_layers: int = 4
  max_positions: int = 128
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads


def layer_norm(x_BxSxD, p, eps=1e-5):
  """In fp32, scale and bias included, whatever the compute dtype (the engine hands vectors over unrounded)."""
  x32 = x_BxSxD.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  return ((x32 - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]).astype(x_BxSxD.dtype)


def dense(x, p):
  return x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype)


class GPT:
  def __init__(self, cfg: GPTConfig):
    self.cfg = cfg

  # ---- params ------------------------------------------------------------------------------------------------

  def init_outer(self, key):
    c, (tokens_key, positions_key) = self.cfg, jax.random.split(key)
    normal = lambda k, shape: 0.02 * jax.random.normal(k, shape, c.param_dtype)
    return {"tokens": normal(tokens_key, (c.vocab_size, c.hidden_size)),
            "positions": normal(positions_key, (c.max_positions, c.hidden_size)),
            "final_norm": self._norm_params()}

  def init_layers(self, keys_L):
    return jax.vmap(self._init_layer)(keys_L)

  def _norm_params(self):
    d = self.cfg.hidden_size
    return {"scale": jnp.ones(d, self.cfg.param_dtype), "bias": jnp.zeros(d, self.cfg.param_dtype)}

  def _init_layer(self, key):
    c, keys = self.cfg, jax.random.split(key, 4)
    d = c.hidden_size
    linear = lambda k, n_in, n_out, std=0.02: {"kernel": std * jax.random.normal(k, (n_in, n_out), c.param_dtype),
                                               "bias": jnp.zeros(n_out, c.param_dtype)}
    residual_std = 0.02 / np.sqrt(2 * c.num_layers)  # GPT-2 scales the projections into the residual stream
    return {"norm_1": self._norm_params(), "qkv": linear(keys[0], d, 3 * d), "proj": linear(keys[1], d, d, residual_std),
            "norm_2": self._norm_params(), "fc": linear(keys[2], d, 4 * d), "out": linear(keys[3], 4 * d, d, residual_std)}

  # ---- training pieces -----------------------------------------------------------------------------------------

  def embed(self, outer, tokens_BxS, positions_BxS=None):
    if positions_BxS is None:
      positions_BxS = jnp.arange(tokens_BxS.shape[1])[None, :]
    h_BxSxD = outer["tokens"][tokens_BxS] + outer["positions"][positions_BxS]
    return h_BxSxD.astype(self.cfg.dtype)

  def _block(self, p, h_BxSxD, attend):
    """One layer; `attend(q, k, v) -> (attention output, extra)` is causal attention, plain or through a cache."""
    c = self.cfg
    batch, seq, _ = h_BxSxD.shape
    qkv_BxSx3D = dense(layer_norm(h_BxSxD, p["norm_1"]), p["qkv"])
    q_BxSxNxH, k_BxSxNxH, v_BxSxNxH = (
        x.reshape(batch, seq, c.num_heads, c.head_dim) for x in jnp.split(qkv_BxSx3D, 3, axis=-1))
    att_BxSxNxH, extra = attend(q_BxSxNxH, k_BxSxNxH, v_BxSxNxH)
    h_BxSxD = h_BxSxD + dense(att_BxSxNxH.reshape(batch, seq, c.hidden_size), p["proj"])
    mlp_BxSxF = jax.nn.gelu(dense(layer_norm(h_BxSxD, p["norm_2"]), p["fc"]))
    return h_BxSxD + dense(mlp_BxSxF, p["out"]), extra

  def layers(self, stacked, h_BxSxD):
    seq = h_BxSxD.shape[1]
    causal_SxS = jnp.tril(jnp.ones((seq, seq), bool))
    attend = lambda q, k, v: (_attention(q, k, v, causal_SxS[None, None]), None)
    h_BxSxD, _ = lax.scan(lambda h, p: self._block(p, h, attend), h_BxSxD.astype(self.cfg.dtype), stacked)
    return h_BxSxD

  def logits(self, outer, h_BxSxD):
    h_BxSxD = layer_norm(h_BxSxD, outer["final_norm"])
    return h_BxSxD @ outer["tokens"].T.astype(h_BxSxD.dtype)  # tied to the token embedding

  def head_loss(self, outer, h_BxSxD, targets_BxS, weights_BxS):
    logits_BxSxV = self.logits(outer, h_BxSxD).astype(jnp.float32)
    losses_BxS = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, targets_BxS)
    return jnp.sum(losses_BxS * weights_BxS)  # a sum: the engine divides by the whole batch's weight

  # ---- generation pieces ---------------------------------------------------------------------------------------

  def init_cache(self, num_layers, batch, max_len):
    shape = (num_layers, batch, max_len, self.cfg.num_heads, self.cfg.head_dim)
    return jnp.zeros(shape, self.cfg.dtype), jnp.zeros(shape, self.cfg.dtype)

  def layers_cached(self, stacked, h_BxSxD, cache, offset, start_B):
    seq, max_len = h_BxSxD.shape[1], cache[0].shape[2]
    slot_S, slot_T = offset + jnp.arange(seq), jnp.arange(max_len)
    visible_Bx1xSxT = ((slot_T[None, :] <= slot_S[:, None])[None] & (slot_T >= start_B[:, None])[:, None])[:, None]

    def one_layer(h, layer):
      p, k_BxTxNxH, v_BxTxNxH = layer

      def attend(q, k, v):
        k_all = lax.dynamic_update_slice_in_dim(k_BxTxNxH, k.astype(k_BxTxNxH.dtype), offset, 1)
        v_all = lax.dynamic_update_slice_in_dim(v_BxTxNxH, v.astype(v_BxTxNxH.dtype), offset, 1)
        return _attention(q, k_all, v_all, visible_Bx1xSxT), (k_all, v_all)

      return self._block(p, h, attend)

    return lax.scan(one_layer, h_BxSxD.astype(self.cfg.dtype), (stacked, *cache))

  # ---- the plain model, for comparison -------------------------------------------------------------------------

  def loss(self, params, batch):
    h_BxSxD = self.layers(params["layers"], self.embed(params["outer"], batch["inputs"]))
    total = self.head_loss(params["outer"], h_BxSxD, batch["targets"], batch["weights"])
    return total / jnp.sum(batch["weights"])


def _attention(q_BxSxNxH, k_BxTxNxH, v_BxTxNxH, visible):
  scores_BxNxSxT = jnp.einsum("bsnh,btnh->bnst", q_BxSxNxH, k_BxTxNxH) / np.sqrt(q_BxSxNxH.shape[-1])
  scores_BxNxSxT = jnp.where(visible, scores_BxNxSxT.astype(jnp.float32), -1e30)
  probs_BxNxSxT = jax.nn.softmax(scores_BxNxSxT, axis=-1).astype(v_BxTxNxH.dtype)
  return jnp.einsum("bnst,btnh->bsnh", probs_BxNxSxT, v_BxTxNxH)


def random_batch(rng, rows, seq, vocab):
  tokens = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((rows, seq), np.float32)}


def main():
  model, seq, rows = GPT(GPTConfig()), 32, 8
  plan = sljax.make_plan(model, seq, rows, sljax.default_budget(), sub_batches=2, live_layers=2)
  print(plan.describe())
  engine = sljax.Engine(model, optax.adamw(1e-3), plan.engine)
  state = engine.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = random_batch(rng, rows, seq, model.cfg.vocab_size)  # one batch, learned by heart
  for step in range(20):
    state, loss = engine.step(state, batch)  # consumes state: only the returned one is used
    if step % 5 == 0:
      print(f"step {step}: loss {float(loss):.3f}")
  layout = generate_plan.plan(model, 8, 8, *generate_plan.memory_budgets(), batch=1, live_layers=2)
  print(layout.describe(model))
  generator = OffloadedGenerator(model, layout.offload)
  weights = generator.load(jax.tree.map(np.asarray, engine.params(state)))
  out = generator.generate(weights, [list(batch["inputs"][0, :8])], SamplingConfig(max_new_tokens=8))
  print("prompt", batch["inputs"][0, :8].tolist(), "->", out.tokens[0].tolist(),
        "(training continued it with", batch["inputs"][0, 8:16].tolist(), ")")


if __name__ == "__main__":
  main()
