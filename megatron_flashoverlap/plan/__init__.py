"""The planner: prices the step lists the executor runs (schedules/) on a described cluster (pure: stdlib,
schedules, config). See plan/cli.py for the command line."""
