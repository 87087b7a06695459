"""Tools a user runs beside training: what `pip install` ships that is not a layer or an operator.

    calibrate_allreduce.py   `python -m megatron_flashoverlap.tools.calibrate_allreduce`: the latency table
                             `all_reduce(algo="auto")` reads (plan/chooser.py)
"""
