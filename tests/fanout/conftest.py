"""One Dask cluster for the fan-out tests of a session (starting one takes seconds)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="session")
def dask_client() -> Iterator[Any]:
    """A client of a two-worker ``LocalCluster``: separate processes, one thread each, as a real cluster's workers
    are other processes (each result crosses a pickle)."""
    with (
        distributed.LocalCluster(
            n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0", silence_logs=40
        ) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        yield client
