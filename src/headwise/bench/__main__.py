"""``python -m headwise.bench``; also the entry point of the memory subprocess."""

from .cli import main

main()
