"""The engine over a data x fsdp mesh equals the single-device engine and the plain full-batch step; it sends the
documented bytes between devices, restores checkpoints of another mesh shape, and runs as several processes.

Run on CPU with 8 forced host devices (conftest.py). This file doubles as the worker of the two-process test:
`python tests/test_mesh.py <coordinator> <process id> <out.json>`.
"""

import fractions
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import REPO, init_params, make_batch, reference_steps, rel_error

sys.path.insert(0, REPO)  # run as the worker script, only tests/ is on the path
from models.presets import build, get_config  # noqa: E402
from sljax.checkpoint import Checkpointer  # noqa: E402
from sljax.memory import HOST, Placement, tree_bytes  # noqa: E402
from sljax.mesh import initialize_distributed, make_mesh, parse_mesh, state_spec  # noqa: E402
from sljax.schedule import Engine, EngineConfig  # noqa: E402

P = jax.sharding.PartitionSpec
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


@functools.cache  # one object per shape: the engines of a model share their compiled calls
def tiny_model(dtype="float32", hidden=16, family="llama"):
  return build(get_config("llama-tiny", dict(family=family, num_layers=2, hidden_size=hidden, intermediate_size=24,
                                             num_heads=2, num_kv_heads=2, dtype=dtype)))


def placement(data, fsdp):
  return Placement(make_mesh({"data": data, "fsdp": fsdp}))


def with_devices(count: int) -> str:
  """This process's XLA_FLAGS (conftest.py's compile flags) for a subprocess with `count` host devices."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  return f"--xla_force_host_platform_device_count={count} {flags}".strip()


def run_engine(model, optimizer, cfg, place, params, batches):
  engine = Engine(model, optimizer, cfg, place)
  state, losses = engine.from_params(params), []
  for batch in batches:
    state, loss = engine.step(state, batch)
    losses.append(float(loss))
  return engine, state, losses


# ---- fidelity ----------------------------------------------------------------------------------------------------

# The shapes the fidelity test draws from, few of them (as in test_engine.py): an example of a known mesh and model
# reuses their compiled calls, a new model compiles the reference and a single-device engine, a new mesh a sharded
# engine (each half a minute on CI's 2 cores). Between them: both axes, data only and fsdp only; fsdp 8 over hidden
# 12, where some leaves have no dimension 8 divides and stay whole; both families; 1 and 2 sub-batches, 1 and 2
# layers per group. Values, placements, clipping and the optimizer vary freely.
# Each: (data, fsdp), family, hidden size, sub-batches, layers per group.
MESH_SHAPES = [((2, 4), "llama", 16, 2, 1), ((4, 1), "llama", 16, 2, 1), ((1, 8), "opt", 12, 1, 2)]


@functools.cache  # one object per optimizer: its engines and reference steps share their compiled updates
def _optimizer(name: str):
  return optax.sgd(1.0) if name == "sgd" else optax.adamw(1e-3, weight_decay=0.1)


@st.composite
def mesh_cases(draw):
  mesh, family, hidden, sub_batches, live_layers = draw(st.sampled_from(MESH_SHAPES))
  cfg = EngineConfig(sub_batches=sub_batches, live_layers=live_layers,
                     grad_clip_norm=draw(st.sampled_from([0.0, 0.05])), activations_on_host=draw(st.booleans()),
                     device_state_groups=draw(st.integers(0, 1)))
  return mesh, cfg, (family, hidden), draw(st.sampled_from(["sgd", "adamw"])), draw(st.integers(0, 2**16))


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mesh_cases())
def test_sharded_step_equals_single_device_step_and_full_batch_step(case):
  (data, fsdp), cfg, model_shape, optimizer_name, seed = case
  model = tiny_model(hidden=model_shape[1], family=model_shape[0])
  optimizer = _optimizer(optimizer_name)
  rng = np.random.default_rng(seed)
  params = init_params(model, seed)
  batches = [make_batch(rng, 8 * cfg.sub_batches) for _ in range(2)]
  want_losses, want_params = reference_steps(model, optimizer, cfg.grad_clip_norm, params, batches)

  single, single_state, single_losses = run_engine(model, optimizer, cfg, Placement.single(), params, batches)
  sharded, state, losses = run_engine(model, optimizer, cfg, placement(data, fsdp), params, batches)

  np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert rel_error(sharded.params(state), single.params(single_state)) <= 1e-5
  assert rel_error(sharded.params(state), want_params) <= 1e-5
  # The state stays in the layout abstract_state promises (so nothing recompiles and checkpoints restore in place).
  settled = sharded.settle(state)  # clipping: without the updates parked for the next step, as checkpoints hold it
  for got, want in zip(jax.tree.leaves(settled), jax.tree.leaves(sharded.abstract_state(jax.random.key(0)))):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)


def test_state_spec_splits_the_largest_divisible_dimension_never_the_layer_axis():
  assert state_spec((2, 24, 16), 8) == P(None, "fsdp")
  assert state_spec((2, 16, 24), 8) == P(None, None, "fsdp")
  assert state_spec((2, 16, 16), 4) == P(None, "fsdp")  # a tie: the first
  assert state_spec((8, 12), 8) == P()  # only the layer axis divides: stays whole
  assert state_spec((2, 24), 1) == P() and state_spec((), 4) == P()


def test_state_is_sharded_over_fsdp_in_pinned_host_memory():
  engine = Engine(tiny_model("bfloat16"), optax.adamw(1e-3), EngineConfig(), placement(2, 4))
  state = engine.init(jax.random.key(0))
  for name in ("master", "opt", "weights"):
    for x in jax.tree.leaves(state["groups"][0][name]):
      assert x.sharding.memory_kind == HOST
      if x.ndim:  # Adam's step count is a scalar
        assert "fsdp" in x.sharding.spec
        assert x.addressable_shards[0].data.size == x.size // 4  # each device's host holds a quarter
  for x in jax.tree.leaves((state["outer"], state["outer_opt"])):  # embeddings + head: on the device, split too
    assert x.sharding.memory_kind == "device"
    assert x.sharding.spec == state_spec(x.shape, 4)
    assert x.addressable_shards[0].data.size == x.size // (4 if "fsdp" in x.sharding.spec else 1)
  assert any("fsdp" in x.sharding.spec for x in jax.tree.leaves(state["outer"]))


# ---- bytes -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_each_group_is_gathered_once_and_reduced_once_per_step_with_the_documented_bytes():
  """data 2 x fsdp 4, bf16 compute, everything on the host, 2 sub-batches: the sub-batch calls communicate nothing;
  between devices: one all-gather per group and pass, one reduce per group, one all-gather and one reduce of the
  embeddings + head (see sljax/schedule.py); over PCIe each data replica moves its own copy of the shards."""
  d, f = 2, 4
  n = d * f
  model = tiny_model("bfloat16")
  cfg = EngineConfig(sub_batches=2, live_layers=1, grad_clip_norm=0.5)
  batch = make_batch(np.random.default_rng(0), 2 * n)
  params = jax.jit(model.init)(jax.random.key(0))  # op by op it compiled a program per operation

  engine = Engine(model, optax.adamw(1e-3), cfg, placement(d, f))
  state = engine.from_params(params)
  compiled = {}
  for name in ("_embed", "_forward", "_tail_forward", "_head", "_tail_backward", "_backward", "_embed_backward"):
    _record_first_call(engine, name, compiled)
  state, _ = engine.step(state, batch)  # the second step is the steady one: it applies the parked updates
  before = dict(engine.place.moved)
  engine.step(state, batch)
  moved = {k: engine.place.moved[k] - before[k] for k in before}

  for name, (fn, args) in compiled.items():
    hlo = fn.lower(*args).compile().as_text()
    assert not COLLECTIVE.findall(hlo), f"{name} communicates: {COLLECTIVE.findall(hlo)}"

  groups = len(engine.groups)
  weights = tree_bytes(state["groups"][0]["weights"])  # bf16 (deleted arrays still know their shapes)
  fp32 = tree_bytes(state["groups"][0]["master"])
  outer_leaves = jax.tree.leaves(params["outer"])
  split = sum(x.nbytes for x in outer_leaves if "fsdp" in state_spec(x.shape, f))  # embeddings + head shards
  whole = sum(x.nbytes for x in outer_leaves) - split  # leaves fsdp divides in no dimension
  frac = fractions.Fraction
  per_device = (frac(f - 1, f) * (2 * groups - 1) * weights
                + groups * (frac(f - 1, f) + frac(2 * (d - 1), d * f)) * fp32
                + frac(f - 1, f) * split  # embeddings + head gathered once
                + (frac(f - 1, f) + frac(2 * (d - 1), d * f)) * split + frac(2 * (n - 1), n) * whole  # their grads
                + frac(2 * (n - 1), n) * 4)  # the loss
  assert moved["between_devices"] == n * per_device

  single = Engine(model, optax.adamw(1e-3), cfg, Placement.single())
  single_state, _ = single.step(single.from_params(params), batch)
  before = dict(single.place.moved)
  single.step(single_state, batch)
  single_moved = {k: single.place.moved[k] - before[k] for k in before}
  group_state = tree_bytes((state["groups"][0]["master"], state["groups"][0]["opt"]))
  # Per group: weights in for the backward (not the last group's) and out once, state in (with the parked fp32
  # gradient, for the update before the group's forward) and out, the gradient parked. Shards move once per data
  # replica; Adam's step count (a scalar) is whole on every device.
  count = groups * sum(x.nbytes for x in jax.tree.leaves(state["groups"][0]["opt"]) if x.ndim == 0)
  replicated_in = groups * (weights + group_state + fp32) - weights - count
  replicated_out = groups * (weights + group_state + fp32) - count
  assert moved["host_to_device"] - single_moved["host_to_device"] == (d - 1) * replicated_in + (n - 1) * count
  assert moved["device_to_host"] - single_moved["device_to_host"] == (d - 1) * replicated_out + (n - 1) * count


def _record_first_call(engine, name, compiled):
  fn = getattr(engine, name)

  def recorded(*args):
    abstract = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
    compiled.setdefault(name, (fn, jax.tree.map(abstract, args)))
    return fn(*args)

  setattr(engine, name, recorded)


# ---- checkpoints -------------------------------------------------------------------------------------------------

def test_checkpoint_of_one_mesh_shape_restores_on_another(tmp_path):
  model = tiny_model("bfloat16")
  cfg = EngineConfig(live_layers=1, device_state_groups=1)  # host groups and a device-resident group
  writer = Engine(model, optax.adamw(1e-3), cfg, placement(2, 4))
  state = writer.init(jax.random.key(1))
  checkpointer = Checkpointer(str(tmp_path), save_every=1)
  checkpointer.save(3, state, {"data_step": 3})
  checkpointer.close()

  for data, fsdp in [(1, 8), (4, 1)]:
    reader = Engine(model, optax.adamw(1e-3), cfg, placement(data, fsdp))
    abstract = reader.abstract_state(jax.random.key(1))
    step, restored, _ = Checkpointer(str(tmp_path), save_every=1).restore_latest(abstract)
    assert step == 3
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
      assert got.sharding == want.sharding
    for got, want in zip(jax.tree.leaves(reader.params(restored)), jax.tree.leaves(writer.params(state))):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- errors ------------------------------------------------------------------------------------------------------

def test_mesh_that_does_not_divide_the_devices_is_refused():
  with pytest.raises(ValueError, match="6 devices, which does not divide the 8 devices"):
    make_mesh("data:3,fsdp:2")
  with pytest.raises(ValueError, match="axis:size"):
    parse_mesh("data=2")
  assert parse_mesh("fsdp:4") == {"data": 1, "fsdp": 4}


def test_batch_not_divisible_over_the_devices_is_refused_before_anything_moves():
  engine = Engine(tiny_model(), optax.sgd(1.0), EngineConfig(sub_batches=2), placement(2, 2))
  state = engine.init(jax.random.key(0))
  before = dict(engine.place.moved)
  with pytest.raises(ValueError, match="batch of 12 rows is not divisible by 2 sub-batches x 4 devices"):
    engine.step(state, make_batch(np.random.default_rng(0), 12))
  assert engine.place.moved == before


def test_unreachable_coordinator_times_out_with_a_message():
  start = time.monotonic()
  with pytest.raises(TimeoutError, match=r"coordinator 127.0.0.1:\d+ could not be reached within 1 s"):
    initialize_distributed(f"127.0.0.1:{_free_port()}", num_processes=2, process_id=1, timeout_s=1)
  assert time.monotonic() - start < 10


# ---- several processes -------------------------------------------------------------------------------------------

WORKER_DEVICES = 2


def _worker_engine(place):
  model = tiny_model()
  engine = Engine(model, optax.adamw(1e-2), EngineConfig(sub_batches=2, live_layers=1), place)
  rng = np.random.default_rng(0)
  return engine, [make_batch(rng, 16) for _ in range(2)]


def _losses(engine, batches):
  state, losses = engine.init(jax.random.key(0)), []
  for batch in batches:
    state, loss = engine.step(state, batch)
    losses.append(float(loss))
  return losses


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
  """Two processes of 2 CPU devices each (mesh data 2 x fsdp 2: fsdp within a process, data across) run two steps;
  their losses equal one process's on a 2 x 2 mesh."""
  address = f"127.0.0.1:{_free_port()}"
  # XLA:CPU launches each local device's part of a program on a client thread pool of max(cores, local devices)
  # threads, 2 on CI's 2 cores. A launch waiting for room among its device's 32 programs in flight holds one thread,
  # while the other runs an all-gather that waits for the part that has no thread left: the worker hangs, and the
  # other in its next all-reduce (a 600-step run of this worker hung every time, within 140-500 steps). A pool of
  # twice the local devices (PJRT_NPROC) leaves a thread for every part: 3,000 steps, no hang. sljax's CPU mesh has
  # one device per process (sljax.mesh.default_mesh_shape), whose programs launch on the calling thread.
  env = dict(os.environ, XLA_FLAGS=with_devices(WORKER_DEVICES), JAX_PLATFORMS="cpu",
             PJRT_NPROC=str(2 * WORKER_DEVICES))
  workers = [subprocess.Popen([sys.executable, __file__, address, str(i), str(tmp_path / f"{i}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    want = _losses(*_worker_engine(placement(2, WORKER_DEVICES)))
    outputs = [worker.communicate(timeout=240)[0] for worker in workers]
  except subprocess.TimeoutExpired:
    for worker in workers:
      worker.kill()
    tails = [worker.communicate()[0][-1500:] for worker in workers]
    pytest.fail(f"the two workers did not finish within 240 s (hung in a collective?); their output's ends:\n"
                f"{tails[0]}\n---\n{tails[1]}")
  finally:
    for worker in workers:
      worker.kill()  # none is left running, whatever failed
  for worker, output in zip(workers, outputs):
    assert worker.returncode == 0, output[-3000:]
  for i in range(2):
    result = json.loads((tmp_path / f"{i}.json").read_text())
    assert result["mesh"] == {"data": 2, "fsdp": WORKER_DEVICES}
    np.testing.assert_allclose(result["losses"], want, rtol=1e-5)


@pytest.mark.slow
def test_a_signal_to_one_host_stops_every_host_after_the_same_step(tmp_path):
  """SIGTERM reaches only the second of two train.py processes: both finish the same step, save it and exit 0
  (without agreeing, the first would wait forever in the next step's collectives)."""
  address, workdir, log = f"127.0.0.1:{_free_port()}", tmp_path / "run", tmp_path / "loss.jsonl"
  env = dict(os.environ, XLA_FLAGS=with_devices(1), JAX_PLATFORMS="cpu")
  tiny = ["--set=num_layers=2", "--set=hidden_size=32", "--set=intermediate_size=64", "--set=num_heads=2",
          "--seq_len=16", "--batch_size=4", "--max_tokens=10000000", "--log_every=1", "--steps=100000",
          "--checkpoint_every=100000"]
  workers = [subprocess.Popen([sys.executable, "train.py", f"--workdir={workdir}", *tiny, f"--loss_log={log}",
                               f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}"],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
  try:
    deadline = time.time() + 180
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):  # the first process logs
      assert time.time() < deadline and all(w.poll() is None for w in workers), "training did not start"
      time.sleep(0.05)
    workers[1].send_signal(signal.SIGTERM)
    outputs = [worker.communicate(timeout=120)[1] for worker in workers]
  finally:
    for worker in workers:
      worker.kill()
  assert [worker.returncode for worker in workers] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
  last = json.loads(log.read_text().splitlines()[-1])["step"]
  assert f"another process's stop signal: stopped after step {last}" in outputs[0]
  assert f"SIGTERM: stopped after step {last}" in outputs[1]
  assert (workdir / "checkpoints" / str(last)).is_dir()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker(address: str, process_id: int, out: str):
  initialize_distributed(address, num_processes=2, process_id=process_id, timeout_s=60)
  place = Placement(make_mesh({"data": 2, "fsdp": WORKER_DEVICES}))
  losses = _losses(*_worker_engine(place))
  with open(out, "w") as f:
    json.dump({"mesh": dict(place.mesh.shape), "losses": losses}, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
