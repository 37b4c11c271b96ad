"""Targets (kimi_linear family, llama family) and the DSpark draft."""
