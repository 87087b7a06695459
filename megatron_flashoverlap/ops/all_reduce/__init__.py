"""The all-reduce family: all_reduce.py (the plain functions of every algorithm, registered, and the public
`all_reduce`), select.py (where a group's ranks sit, the decode shape), choose.py (the decode all-reduce's measured
pick)."""
