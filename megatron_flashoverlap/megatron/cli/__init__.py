"""The command line: the `--flash-overlap` flags, the launcher for Megatron-LM's scripts, the project's entry.

    args.py           the `--flash-overlap` flags for Megatron's parser (shared by the launcher and the patch)
    launch.py         `python -m megatron_flashoverlap.launch` / `flashoverlap-launch` (`--cpu`, `--nproc-per-node`)
    failures.py       a failed rank tells the launcher, which kills the ranks left stuck after a short grace
    engine_watch.py   the server's guard: 503 naming the cause once rank 0 or its engine is gone, or stopping
    request_checks.py requests checked before they reach the engine (a clear 4xx, never an engine crash)
    pretrain_gpt.py   `python -m megatron_flashoverlap.pretrain_gpt`: Megatron's pretrain() with our spec on mock data
    generate.py       `python -m megatron_flashoverlap.generate`: offline_inference.py's job through
                      the wheel (MegatronLLM, greedy) from a pretrain_gpt.py checkpoint
    serve.py          `python -m megatron_flashoverlap.serve`: launch_inference_server.py's job through the wheel
                      (MegatronAsyncLLM.serve, Megatron's OpenAI-compatible HTTP server) on the same model
"""
