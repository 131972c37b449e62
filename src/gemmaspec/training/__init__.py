"""Drafter training: distil an MTP assistant from a target (``gemmaspec train-drafter``).

Modules: :mod:`.corpus` (the text and its sources), :mod:`.teacher` (the target's signals over it,
cached in chunks), :mod:`.train` (the loop), :mod:`.qat` (Q4_0 fake quantization), :mod:`.cli` (the
commands). The trainable assistant itself is an architecture file
(:mod:`gemmaspec.models.gemma4_assistant_train`), made and written through
:mod:`gemmaspec.loading.assistant_gguf`, so this package knows no architecture.
"""
