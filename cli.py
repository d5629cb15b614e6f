"""Run the ``adapt`` CLI from a source checkout (``python cli.py ...``); the code is in ``adapt/cli.py``."""
from adapt.cli import main

if __name__ == "__main__":
    main()
