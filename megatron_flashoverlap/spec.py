"""`--spec megatron_flashoverlap.spec flashoverlap_layer_spec`: the spec lives in the Megatron wing."""
from .megatron.spec import (FlashOverlapSpecProvider, flashoverlap_layer_spec, hybrid_stack_spec, layer_spec,
                            resolve_flash_config)

__all__ = ["FlashOverlapSpecProvider", "flashoverlap_layer_spec", "hybrid_stack_spec", "layer_spec",
           "resolve_flash_config"]
