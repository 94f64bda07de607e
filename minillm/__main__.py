"""`python -m minillm <command>`: the commands are cli.py's."""
import sys

from .cli import main

sys.exit(main())
