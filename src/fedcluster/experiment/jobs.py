"""Jobs in parallel: a run's (algorithm, seed) jobs over local worker processes.

A run, a compare or a sweep is a list of independent jobs, one per seed ×
algorithm entry (a sweep's settings are labelled entries). With ``jobs: N``
(``--jobs N``) they run over N worker processes of a
``concurrent.futures.ProcessPoolExecutor`` (spawn context: no forked torch
threads), each process limited to its share of the CPUs
(``torch.set_num_threads(max(1, cores // N))``) while its simulator keeps the
driver's thread count for the MLP kernel's client groups (a client's float
rounding depends on its group's shapes, :class:`~fedcluster.experiment.runner.SimulatorFactory`).

Every job is computed exactly as in a sequential run: all randomness is
derived from (seed, purpose, round, client) (:mod:`fedcluster.rng`) and each
job builds its seed's federation, model and initial row from the config, so
its rows are the sequential run's. Each worker writes its job's rows,
checkpoints and artifacts into the run directory itself (the tables under
:meth:`~fedcluster.experiment.rundir.RunDirectory.tables_locked`), and the driver puts the
rows in the sequential order (job, then round) at the end, writes the
summary and the report: the run directory equals a sequential run's, timing
columns aside. A killed parallel run resumes job by job from each job's own
checkpoint, with any number of jobs.

A callback passed from Python runs where its job runs: ``on_job_start``,
``on_round_end`` and ``on_job_end`` on a copy in the job's worker process,
``on_run_start`` and ``on_run_end`` in the driver.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING

from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.experiment.callbacks import Callback
from fedcluster.experiment.rundir import JobResult

if TYPE_CHECKING:
    from torch import nn

    from fedcluster.data.federation import Federation
    from fedcluster.engine.modes import LossFn


def threads_per_job(jobs: int) -> int:
    """Torch threads of each of ``jobs`` worker processes: the CPUs this process may
    use, shared equally (at least one)."""
    return max(1, len(os.sched_getaffinity(0)) // jobs)


def run_jobs(
    task: Callable[[int, int], JobResult],
    order: list[tuple[int, int]],
    workers: int,
    labels: list[str],
    path: Path,
    progress: bool,
) -> list[JobResult]:
    """``task(seed, entry)`` for every job of ``order`` over ``workers`` processes (``task``
    must pickle: the pool sends it to them); the results in the order given."""
    context = get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures: list[Future[JobResult]] = [pool.submit(task, seed, i) for seed, i in order]
        try:
            results = []
            for (seed, i), future in zip(order, futures, strict=True):
                results.append(future.result())
                if progress:
                    print(f"fedcluster: job {labels[i]} seed {seed} done", flush=True)
            return results
        except BrokenProcessPool:
            raise FedclusterError(
                f"a job's worker process died (killed, or out of memory); "
                f"`fedcluster resume {path}` continues every job from its last checkpoint"
            ) from None
        finally:
            for future in futures:
                future.cancel()


def picklable(
    model: nn.Module | None,
    federation: Federation | None,
    loss: LossFn | None,
    callbacks: list[Callback],
) -> tuple[nn.Module | None, Federation | None, LossFn | None, list[Callback]]:
    """What the workers receive besides the config, checked to cross a process boundary."""
    given = (model, federation, loss, callbacks)
    for name, obj in zip(("model", "federation", "loss", "callbacks"), given, strict=True):
        check_sendable(obj, f"jobs: the {name} passed from Python", "run with jobs: 1")
    return given


def check_sendable(obj: object, what: str, remedy: str) -> None:
    """A :class:`ConfigError` naming ``what`` and the ``remedy`` when ``obj`` cannot be
    pickled, i.e. sent to another process."""
    try:
        pickle.dumps(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{what} cannot be sent to a worker process ({exc}); {remedy}") from None
