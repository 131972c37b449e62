"""Model architectures, one file each. All share one contract (:class:`gemmaspec.models.base.CausalLM`)."""
