"""Studies of the papers' experiments beside the scoreboard harness
(:mod:`fedcluster.reproduce`; docs/reproduction.md, docs/privacy.md, docs/clustering.md)."""
