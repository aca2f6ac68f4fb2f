"""`python -m pdrun`: the same command as the `pdrun` script, for a Python whose packages were not pip-installed
(the tree on PYTHONPATH, e.g. a GPU host's own torch)."""

from pdrun.cli import main

if __name__ == "__main__":
    main(prog_name="pdrun")
