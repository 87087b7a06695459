"""All-reduce on P2P steps (ring, recursive doubling, hierarchical) and the measured choice against stock."""
