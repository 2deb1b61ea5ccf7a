"""``python -m sdcscope``: the ``sdcscope`` command."""

from sdcscope.cli import main

if __name__ == "__main__":
    main()
