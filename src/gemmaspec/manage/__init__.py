"""Model management: the catalog of known checkpoints (:mod:`.catalog`), downloads and the local cache
(:mod:`.hub`), the embedded default model (:mod:`.default_model`), the assistants gemmaspec ships
(:mod:`.shipped`) and "will it fit?" (:mod:`.fit`).

Reading and writing model files is :mod:`gemmaspec.loading`'s job; this package decides *which*
file, and whether it fits, without loading weights.
"""
