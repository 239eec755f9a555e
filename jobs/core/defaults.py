"""Defaults and limits that both the settings and the CLI's options name.

Kept free of any import, so that ``clipmill --help`` can show them without loading the
database layer (``tests/test_packaging.py`` times it).
"""

DEFAULT_DRAWS = 8  # renders a shapes-world clip may take until it reads as asked (jobs.runner.draws)
MAX_DRAWS = 16
