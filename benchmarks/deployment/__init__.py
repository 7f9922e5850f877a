"""Real Flower nodes: per-message overhead, a lost node, a minimal hand-written app
(docs/flower.md, docs/benchmarks.md)."""
