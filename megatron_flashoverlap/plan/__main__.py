"""python -m megatron_flashoverlap.plan: the planner's command line (plan/cli.py)."""
from .cli import main

raise SystemExit(main())
