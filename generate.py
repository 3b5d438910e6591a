"""`python generate.py`: the command line of sljax.cli.generate (`sljax-generate` where sljax is installed); its
--help is that module's."""

from sljax.cli import generate

if __name__ == "__main__":
  generate.console()
