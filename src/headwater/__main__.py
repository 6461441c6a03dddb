"""``python -m headwater``: the same as the ``headwater`` command."""

from headwater.cli.main import main

if __name__ == "__main__":
    main()
