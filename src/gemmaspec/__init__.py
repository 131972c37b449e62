"""gemmaspec: Gemma models on a small CPU or GPU, with speculative decoding.

Public entry points: :func:`gemmaspec.engine.load_engine` and the ``gemmaspec`` command
(:mod:`gemmaspec.cli`).
"""

__version__ = "0.1.0"
