"""`python -m gradbuilder`: the same command as the `gradbuilder` console script."""

from .cli import main

raise SystemExit(main())
