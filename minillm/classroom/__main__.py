"""python -m minillm.classroom (the documented form); `python minillm/classroom/__main__.py` runs the same code.

Either way the code that runs is this tree's: a submission is only ever read, between its markers."""
import os
import sys

if not __package__:   # run as a script: this tree's package, not whatever else is on sys.path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from minillm.classroom.cli import main
else:
    from .cli import main

sys.exit(main())
