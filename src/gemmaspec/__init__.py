"""gemmaspec: Gemma models on a small CPU or GPU, with speculative decoding.

Public entry points: :func:`gemmaspec.loader.load_engine` (a target ready to generate),
:func:`gemmaspec.loader.drafter_factory` (the drafter ``--spec-type`` asks for),
:func:`gemmaspec.loading.load_checkpoint` (any supported checkpoint as a built model) and the
``gemmaspec`` command (:mod:`gemmaspec.cli`).
"""

__version__ = "0.1.0"
