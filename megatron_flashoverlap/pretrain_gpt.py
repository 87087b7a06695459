"""`python -m megatron_flashoverlap.pretrain_gpt [--cpu] [--nproc-per-node N] ...`: the entry lives in the Megatron wing."""
from .megatron.cli.pretrain_gpt import main

if __name__ == "__main__":
    main()
