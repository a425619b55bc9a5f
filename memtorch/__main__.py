"""python -m memtorch: the command line (memtorch/cli.py)."""

from memtorch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
