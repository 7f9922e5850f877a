"""Speed: rounds of the simulator against plain loops and Flower, scale, load
(docs/benchmarks.md)."""
