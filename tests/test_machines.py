"""Machine facts: the table, this machine's RAM, XLA's memory settings and the default budgets built from them."""

import math
import os
import types

import jax
import pytest

from sljax import machines
from sljax.machines import GIB, H200, MACHINES, MEMORY_FRACTION_ENV, PINNED_FRACTION, PINNED_POOL_ENV


def gpu(bytes_limit: int):
  """A stand-in for a jax.Device of a GPU (default_budget reads its platform and allocator limit only)."""
  return types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": bytes_limit})


def test_ram_is_read_from_meminfo():
  info = machines.meminfo()
  assert machines.ram_bytes() == info["MemTotal"] > machines.available_ram_bytes() == info["MemAvailable"] > 0


@pytest.mark.parametrize("pool_gib", [None, 2, 10_000])
def test_a_gpu_host_budget_is_its_share_of_three_quarters_of_ram_within_its_pool(monkeypatch, pool_gib):
  if pool_gib is None:
    monkeypatch.delenv(PINNED_POOL_ENV, raising=False)
  else:
    monkeypatch.setenv(PINNED_POOL_ENV, str(pool_gib))
  pool = (pool_gib or machines.XLA_PINNED_POOL_GIB) * GIB
  for sharing in (1, 4):
    budget = machines.default_budget(gpu(80 * GIB), sharing=sharing)
    assert budget.device_bytes == 80 * GIB
    assert budget.host_bytes == min(int(PINNED_FRACTION * machines.ram_bytes()) // sharing, pool)


def test_pinned_pools_are_capped_per_gpu_unless_the_user_set_them(monkeypatch):
  monkeypatch.setenv(PINNED_POOL_ENV, "")  # restored after the test, whatever cap_pinned_pools sets
  monkeypatch.delenv(PINNED_POOL_ENV)
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
  machines.cap_pinned_pools(100 * GIB)
  assert machines.pinned_pool_bytes() == 50 * GIB
  machines.cap_pinned_pools(10 * GIB)  # the first value stands, as a user's would
  assert machines.pinned_pool_bytes() == 50 * GIB


@pytest.fixture
def xla_unset(monkeypatch):
  """XLA's memory variables unset, and unset again after the test, whatever configure_process sets."""
  for name in (MEMORY_FRACTION_ENV, PINNED_POOL_ENV):
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


@pytest.mark.parametrize("visible,pool_gib", [("0", 110), ("0,1", 55), ("3,1,0,2", 27)])
def test_configure_process_caps_each_gpus_pool_at_its_share_of_the_budget_and_headroom(xla_unset, monkeypatch,
                                                                                        visible, pool_gib):
  # XLA gives every GPU its own pinned pool: the cap is per GPU, so a process's budget is split among its GPUs.
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
  machines.configure_process(host_memory_gib=100)
  assert os.environ[PINNED_POOL_ENV] == str(pool_gib)
  assert os.environ[MEMORY_FRACTION_ENV] == str(machines.XLA_MEMORY_FRACTION)


def test_configure_process_defaults_to_the_host_budget_and_keeps_what_the_user_set(xla_unset, monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
  monkeypatch.setenv(MEMORY_FRACTION_ENV, "0.5")
  machines.configure_process()
  assert machines.pinned_pool_bytes() == int(PINNED_FRACTION * machines.ram_bytes() / GIB) * GIB
  assert os.environ[MEMORY_FRACTION_ENV] == "0.5"


@pytest.mark.parametrize("gib", [math.inf, math.nan, -1.0])
def test_configure_process_refuses_a_budget_that_is_no_number_of_gib_before_setting_anything(xla_unset, gib):
  with pytest.raises(ValueError, match=rf"^--host_memory_gib must be a number of GiB >= 0 \(0: .*\), got {gib}$"):
    machines.configure_process(gib)
  assert MEMORY_FRACTION_ENV not in os.environ and PINNED_POOL_ENV not in os.environ


def test_unmeasured_gpus_keep_the_h200s_proportions():
  a100 = MACHINES["a100-80gb"]
  assert a100.copy_both_bytes_per_s / a100.copy_bytes_per_s == pytest.approx(H200.copy_both_bytes_per_s / 53e9)
  assert a100.generation_flops / a100.peak_flops == pytest.approx(H200.generation_flops / H200.peak_flops)
  assert a100.allocator_bytes < a100.memory_bytes and a100.layer_efficiency == H200.layer_efficiency
  assert machines.rates_of("NVIDIA A100-SXM4-80GB") is a100 and machines.rates_of("cpu") is machines.REFERENCE


def test_growing_a_pinned_pool_holds_what_is_asked_in_chunks_at_once_then_frees_it():
  from sljax.memory import HOST, grow_pinned_pools, live_bytes
  before = live_bytes().get(HOST, 0)
  assert grow_pinned_pools(jax.devices()[:1], 5 * 2**20 + 1, chunk=2**20) == 6 * 2**20  # whole chunks
  assert grow_pinned_pools(jax.devices()[:1], 0, chunk=2**20) == 0
  assert live_bytes().get(HOST, 0) == before  # nothing kept: the pool, not the arrays, is what stays


def test_a_run_grows_each_gpus_pinned_pool_to_its_plan_with_headroom_within_the_cap(monkeypatch):
  from sljax import launch, memory
  from sljax.mesh import make_mesh
  asked = []
  monkeypatch.setattr(memory, "grow_pinned_pools", lambda devices, nbytes: asked.append((list(devices), nbytes)) or 0)
  mesh = make_mesh({"data": 1, "fsdp": 1}, jax.devices()[:1])
  launch.grow_pinned_pools(mesh, 10 * GIB)
  assert asked == []  # a CPU keeps no pinned pool
  monkeypatch.setattr(launch, "has_pinned_pool", lambda device: True)
  monkeypatch.setenv(PINNED_POOL_ENV, "96")
  launch.grow_pinned_pools(mesh, 10 * GIB)
  launch.grow_pinned_pools(mesh, 90 * GIB)  # 99 GiB with the headroom: the cap, less two chunks, is the most
  launch.grow_pinned_pools(mesh, 0)  # the on-device step counts none
  assert asked == [(jax.devices()[:1], int(10 * GIB * machines.PINNED_POOL_HEADROOM)), (jax.devices()[:1], 94 * GIB)]
