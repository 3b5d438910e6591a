"""What the checkpoint a run resumes from fixes, whatever the request or a newer planner would choose now: the
offload engine's state structure (`resumed_engine_state`), a LoRA run's adapters and base (`check_lora_resume`
against `lora_meta`, what a LoRA run's checkpoints record). Each refuses, before anything is allocated, a request
that asks for another.
"""

from typing import NamedTuple

from models.presets import build
from sljax.checkpoint import newest_checkpoint, saved_groups
from sljax.lora.checkpoint import describe_base, run_meta
from sljax.request import Configs, Request
from sljax.schedule import EngineConfig, layout_of, state_on_device
from sljax.sizes import model_sizes


class Resumed(NamedTuple):
  """What the offload engine's checkpoint a run resumes from fixes, being its state's structure, whatever the plan
  would choose now (another budget, a newer planner): the engine, its layer groups, its first moment's dtype, and
  (for a model whose host groups keep a compute copy of their weights, which device groups do not) which groups keep
  their state on the device."""

  live_layers: int
  tail_layers: int
  moments_dtype: str | None
  device_state_groups: int | None  # None: the structure does not fix it


def resumed_engine_state(request: Request, workdir: str, model_cfg) -> Resumed | None:
  """The offload engine's checkpoint in `workdir` that this run resumes from, None where there is none (or another
  model's: the trainer says so). ValueError when the flags ask for another engine, other layer groups or another
  first moment than the checkpoint holds."""
  launch, saved, num_layers = request.launch, saved_groups(workdir), model_cfg.num_layers
  if saved is None or sum(saved.layers) != num_layers:
    return None
  step_dir, group_layers = saved.step_dir, saved.layers
  try:
    live, tail = layout_of(group_layers)
  except ValueError:
    return None
  device_groups = None
  if model_sizes(build(model_cfg)).separate_weights:
    device_groups = saved.host.count(False)
    if state_on_device(len(saved.host), device_groups) != [not host for host in saved.host]:
      return None
  moments = newest_checkpoint(workdir)[1].get("optim", {}).get("moments_dtype")
  asked = []
  if launch.engine == "device":
    asked.append("--engine=device")
  layout = lambda live, tail: EngineConfig(live_layers=live, tail_layers=tail).bounds(num_layers)
  if layout(launch.live_layers or live, launch.tail_layers or tail) != layout(live, tail):
    asked += [f"--{name}={getattr(launch, name)}" for name in ("live_layers", "tail_layers") if getattr(launch, name)]
  if moments and request.optim.get("moments_dtype", moments) != moments:
    asked.append(f"--moments_dtype={request.optim['moments_dtype']}")
  held = (f"the offload engine's state, in layer groups of {live} layer(s) and a last group of {tail}, with a "
          f"{moments or 'float32'} first moment"
          + ("" if device_groups is None else f", {device_groups} of {len(group_layers)} groups' state on the device"))
  if asked:
    raise ValueError(f"checkpoint {step_dir} holds {held}; {' '.join(asked)} asks for another: drop "
                     f"{'them' if len(asked) > 1 else 'it'} to resume, or use another --workdir")
  print(f"note: resuming from {step_dir}, which holds {held}: kept")
  return Resumed(live, tail, moments, device_groups)


def lora_meta(request: Request, configs: Configs) -> dict | None:
  """What the run's checkpoints record of its adapters and base (sljax.lora.checkpoint.run_meta); None when not
  fine-tuning."""
  return None if request.lora is None else run_meta(request.lora, request.launch.hf_dir, configs.data.seed)


def check_lora_resume(workdir: str, lora: dict):
  """ValueError when the newest checkpoint in `workdir` does not hold adapters of this LoRA config on this base:
  resumed, they would train on with another base or config. A workdir without a readable checkpoint passes (the
  trainer starts afresh, or says why it cannot read it)."""
  try:
    step_dir, meta = newest_checkpoint(workdir)
  except ValueError:
    return
  saved = meta.get("lora")
  if saved is None:
    raise ValueError(f"checkpoint {step_dir} holds a full training run's state, not LoRA adapters: use another "
                     f"--workdir")
  describe = {"base": describe_base, "rank": str, "alpha": lambda alpha: f"{alpha:g}",
              "targets": lambda names: ",".join(names) or "every projection"}
  changed = [f"{name} {show(saved.get(name))} saved, {show(lora[name])} asked" for name, show in describe.items()
             if saved.get(name) != lora[name]]
  if changed:
    raise ValueError(f"checkpoint {step_dir} holds LoRA adapters of another base or config than this run's "
                     f"({'; '.join(changed)}): resume with the saved ones, or use another --workdir")

