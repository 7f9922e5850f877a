"""The bundled experiment presets (``<name>.yaml``), read by
:func:`fedcluster.config.schema.load_preset`.
"""
