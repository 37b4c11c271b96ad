"""The decoding core: the engine's compiled programs, the step functions they share with training,
the scheduler that drives them, the speculation-length choice, sampling settings and statistics."""
