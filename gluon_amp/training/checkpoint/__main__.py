"""``python -m gluon_amp.training.checkpoint upgrade OLD NEW``: a package's ``__main__``, so that
runpy does not run again a module importing gluon_amp has imported already (its warning)."""
import sys

from . import main

sys.exit(main())
