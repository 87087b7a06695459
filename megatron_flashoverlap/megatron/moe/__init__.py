"""MoE on Megatron's MoELayer: its alltoall dispatcher runs ops/moe's exchange, or the fused expert pipeline.

    layer.py    FlashMoELayer, FlashAlltoAllTokenDispatcher, flash_moe_spec, check_moe_config
    fused.py    moe.algo = flash: what may fuse, and the fused experts call
"""
