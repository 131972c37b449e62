"""``gemmaspec bench``: where speculative decoding pays, by text kind, draft length and number of
users, in this process or against any OpenAI-compatible server (see :mod:`.cli` and
docs/benchmarks.md). :mod:`.suite` reads prompt suites, :mod:`.targets` runs requests, :mod:`.run`
sweeps, :mod:`.analyze` turns raw runs into figures, :mod:`.report` writes report.md and the plots."""
