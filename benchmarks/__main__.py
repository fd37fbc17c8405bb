"""`python -m benchmarks SCENARIO [OPTIONS]` from a checkout (benchmarks/__init__.py)."""

from benchmarks import main

raise SystemExit(main())
