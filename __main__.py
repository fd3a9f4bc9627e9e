"""python -m kvchaos: the command line."""

from kvchaos.harness.cli import main

raise SystemExit(main())
