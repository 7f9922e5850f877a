"""The bundled benchmark suites (``<name>.yaml``), read by
:func:`fedcluster.benchmark.load_suite`.
"""
