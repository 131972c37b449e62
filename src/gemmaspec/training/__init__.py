"""Drafter training: distil an MTP assistant from a target (``gemmaspec train-drafter``).

Modules: :mod:`.corpus` (the text and its sources), :mod:`.teacher` (the target's signals over it,
cached in chunks), :mod:`.assistant` (the trainable assistant), :mod:`.train` (the loop),
:mod:`.export` (the GGUF), :mod:`.qat` (Q4_0 fake quantization), :mod:`.cli` (the commands).
"""
