"""Published GPU measurements the planner is checked against (published.csv; plan/validate.py runs them)."""
