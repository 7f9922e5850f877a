"""Faulty clients, attacks and bad input against fedcluster (docs/reliability.md)."""
