"""``python -m adapt`` (and ``accelerate launch -m adapt ...``) runs the CLI."""
from cli import main

main()
