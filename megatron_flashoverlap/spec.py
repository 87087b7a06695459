"""`--spec megatron_flashoverlap.spec flashoverlap_layer` (or `flashoverlap_layer_spec`): the spec lives in the
Megatron wing."""
from .megatron.spec import (FlashOverlapSpecProvider, FlashOverlapTransformerLayer, flashoverlap_layer,
                            flashoverlap_layer_spec, get_gpt_layer_flashoverlap_spec, hybrid_stack_spec, layer_spec)

__all__ = ["FlashOverlapSpecProvider", "FlashOverlapTransformerLayer", "flashoverlap_layer", "flashoverlap_layer_spec",
           "get_gpt_layer_flashoverlap_spec", "hybrid_stack_spec", "layer_spec"]
