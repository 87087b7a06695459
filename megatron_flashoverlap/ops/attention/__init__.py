"""Attention: core math, query-split attention + projection + reduce-scatter, Ulysses all-to-all."""
