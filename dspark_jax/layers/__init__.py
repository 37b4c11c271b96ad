"""Building blocks: norms, linear/embedding, rope, MLA, KDA, MoE, AttnRes."""
