"""``python -m clipmill.jobs.cli``: the same as the ``clipmill`` command."""

from clipmill.jobs.cli import main

main(prog_name="clipmill")
