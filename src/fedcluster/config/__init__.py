"""Configuration: the validated experiment schema (``schema``), ``--set`` overrides
and sweeps, path and size limits, plugin lookup (names and ``package.module:object``
import paths to objects), the safe YAML reader and the bundled presets. It is the
lowest layer above ``errors``/``rng``: it imports nothing else of fedcluster, so
``import fedcluster.config.schema`` loads no algorithm, no engine and no torch.
"""
