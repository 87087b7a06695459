"""Attention: core.py (the math, masks, the unfused references), query_split.py (query-split attention +
projection + reduce-scatter), ulysses.py (Ulysses all-to-all and attention), ulysses_fused.py (Ulysses with the
projections fused into the all-to-all), choose.py (the Ulysses all-to-all's measured pick)."""
