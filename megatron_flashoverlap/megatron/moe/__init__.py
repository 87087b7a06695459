"""MoE on Megatron's MoELayer (layer.py): FlashMoELayer, FlashAlltoAllTokenDispatcher, flash_moe_spec,
check_moe_config; its alltoall dispatcher runs ops/moe's exchange, or (moe.algo = flash) the fused expert pipeline.
"""
