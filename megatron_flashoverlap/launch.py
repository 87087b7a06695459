"""`python -m megatron_flashoverlap.launch SCRIPT.py ...`: the launcher lives in the Megatron wing."""
from .megatron.cli.launch import main

if __name__ == "__main__":
    main()
