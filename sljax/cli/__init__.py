"""The command lines, importable from the installed package: sljax.cli.train (`python train.py`, `sljax-train`) and
sljax.cli.generate (`python generate.py`, `sljax-generate`), each flags -> configs -> a library call. Importing one
defines its flags; both define --model and --set, so one process loads one of them."""

import sys
import types

from absl import app, flags


def run_command(module: types.ModuleType):
  """Runs `module`'s main under absl as this process's command line. The script that calls it (train.py, or the
  console script pip writes) is __main__: absl's --help shows __main__'s docstring and flags, so both become
  `module`'s."""
  sys.modules["__main__"].__doc__ = module.__doc__
  for flag in flags.FLAGS.get_key_flags_for_module(module.__name__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(module.main)
