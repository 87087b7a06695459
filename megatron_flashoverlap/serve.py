"""`python -m megatron_flashoverlap.serve [--cpu] [--nproc-per-node N] ...`: the entry lives in the Megatron wing."""
from .megatron.cli.serve import main

if __name__ == "__main__":
    main()
