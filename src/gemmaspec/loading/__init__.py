"""Checkpoint loading: GGUF (llama.cpp) files and the default model."""
