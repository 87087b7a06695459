"""`python -m megatron_flashoverlap.generate [--cpu] [--nproc-per-node N] ...`: the entry lives in the Megatron wing."""
from .megatron.cli.generate import main

if __name__ == "__main__":
    main()
