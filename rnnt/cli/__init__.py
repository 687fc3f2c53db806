"""The command-line programs: `train.py`, `eval.py` and scripts/*.py call these `main`s, and
`pip install` makes them the `rnnt-*` commands (pyproject.toml)."""
