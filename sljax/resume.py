"""What the checkpoint a run resumes from asks of the run, before anything is allocated. A full run's checkpoint
(format 2, sljax.checkpoint_layout) fixes no placement: the run's own plan chooses the engine, layer groups and
memory, and the restore lays the state out as it says; only the moments' dtype is kept where the request leaves it
open (`resumed_moments`). Format-1 checkpoints of an engine's state, which held its memory layout, are
refused in one line (`check_resumable`). A LoRA run's adapters and base must match (`check_lora_resume` against
`lora_meta`, what a LoRA run's checkpoints record); its adapters resume under any layer groups, in either layout
(sljax.lora.checkpoint).
"""

from sljax.checkpoint import FORMAT_1_REFUSED, newest_checkpoint, saved_format
from sljax.lora.checkpoint import adapters_format, describe_base, run_meta
from sljax.optim import INT8
from sljax.request import Configs, Request


def check_resumable(workdir: str):
  """ValueError when the newest checkpoint in `workdir` holds an engine's state as sljax's format 1 laid it out
  (layer groups, compute copies), which this sljax does not resume."""
  saved = saved_format(workdir)
  if saved is None:
    return
  step_dir, version, tops = saved
  if version == 1 and tops & {"groups", "params"}:
    raise ValueError(FORMAT_1_REFUSED.format(where=step_dir))


def resumed_moments(request: Request, workdir: str) -> str | None:
  """The moments dtype of the checkpoint in `workdir` that this run resumes from, unless the request names one (None
  then, and where there is no checkpoint): a resume continues with the moments it saved where the plan has room for
  them (where it has not, the plan's choice is taken and the restore casts them). A request for other moments than
  the checkpoint's is refused (ValueError) where either is 8-bit: a restore casts between float dtypes only."""
  try:
    step_dir, meta = newest_checkpoint(workdir)
  except ValueError:
    return None
  saved = meta.get("optim", {}).get("moments_dtype")
  if "moments_dtype" not in request.optim:
    return saved
  asked = request.optim["moments_dtype"]
  if saved is not None and saved != asked and INT8 in (saved, asked):
    raise ValueError(f"checkpoint {step_dir} holds {saved} Adam moments, and this run asks for {asked}: a restore "
                     f"casts only between float dtypes; resume with --moments_dtype={saved}, or use another --workdir")
  return None


def lora_meta(request: Request, configs: Configs) -> dict | None:
  """What the run's checkpoints record of its adapters and base (sljax.lora.checkpoint.run_meta); None when not
  fine-tuning."""
  return None if request.lora is None else run_meta(request.lora, request.launch.hf_dir, configs.data.seed)


def check_lora_resume(workdir: str, lora: dict):
  """ValueError when the newest checkpoint in `workdir` does not hold adapters of this LoRA config on this base
  (resumed, they would train on with another base or config), or holds them in a layout this sljax does not read
  (either layout it reads resumes under any layer groups). A workdir without a readable checkpoint passes (the
  trainer starts afresh, or says why it cannot read it)."""
  try:
    step_dir, meta = newest_checkpoint(workdir)
  except ValueError:
    return
  saved = meta.get("lora")
  if saved is None:
    raise ValueError(f"checkpoint {step_dir} holds a full training run's state, not LoRA adapters: use another "
                     f"--workdir")
  adapters_format(step_dir, saved)
  saved = {"base_bits": 0, **saved}  # written before the base could be quantized
  describe = {"base": describe_base, "rank": str, "alpha": lambda alpha: f"{alpha:g}",
              "targets": lambda names: ",".join(names) or "every projection",
              "base_bits": lambda bits: f"int{bits}" if bits else "unquantized"}
  changed = [f"{name} {show(saved.get(name))} saved, {show(lora[name])} asked" for name, show in describe.items()
             if saved.get(name) != lora[name]]
  if changed:
    raise ValueError(f"checkpoint {step_dir} holds LoRA adapters of another base or config than this run's "
                     f"({'; '.join(changed)}): resume with the saved ones, or use another --workdir")
