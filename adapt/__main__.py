"""``python -m adapt`` (and ``accelerate launch -m adapt ...``) runs the CLI."""
from adapt.cli import main

main()
