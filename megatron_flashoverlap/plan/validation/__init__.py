"""Published GPU measurements the planner is checked against (published.csv; plan/published.py runs them)."""
