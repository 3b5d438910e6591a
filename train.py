"""`python train.py`: the command line of sljax.cli.train (`sljax-train` where sljax is installed); its --help is that
module's."""

from sljax.cli import train

if __name__ == "__main__":
  train.console()
