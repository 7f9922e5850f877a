"""One experiment from its config to its run directory: the runner (jobs,
seeds, rounds), callbacks, the run directory's writers and checkpoints,
metrics, loggers, faulty-client scenarios, what ``config.yaml`` records of
Python objects, the catalog of presets and registered names, the summary
tables and the choice of a finished run's clusters for new devices. It may
import ``algorithms`` and every layer below it.
"""
