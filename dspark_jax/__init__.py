"""dspark-jax: Kimi-K3 DSpark speculative decoding in JAX/Flax.

Library API: `generate`, `load_target`, `load_draft`.
"""

from dspark_jax.api import load_draft, load_target
from dspark_jax.decode.generate import generate

__all__ = ["generate", "load_draft", "load_target"]
