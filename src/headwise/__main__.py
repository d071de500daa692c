"""``python -m headwise``: the ``headwise`` command (``headwise.cli``)."""

from headwise.cli import main

main()
