"""``python -m headwise.bench``; also the entry point of the memory subprocess."""

from .cli import main

if __name__ == "__main__":
    main()
