"""Speculative decoding: drafters propose, :mod:`.verify` decides, the engine loops."""
