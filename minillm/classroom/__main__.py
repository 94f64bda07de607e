"""python -m minillm.classroom: see minillm/classroom/__init__.py."""
import sys

from .cli import main

sys.exit(main())
