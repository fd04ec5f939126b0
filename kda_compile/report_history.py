"""The graphs the ``kda_compile`` backend compiled in this process, latest last (the most recent
:data:`HISTORY`), for ``kda_compile.report()`` without a model. Apart from report.py so that the backend,
which records each graph here, and report.py, which finds the backend behind a compiled model, do not import
each other."""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from kda_compile.passes.report import GraphReport

logger = logging.getLogger("kda_compile.report")

HISTORY = 256  # graphs kept for report() without a model

history: collections.deque[GraphReport] = collections.deque(maxlen=HISTORY)
lock = threading.Lock()  # guards history and report.py's tables of eager fallbacks and graph breaks

last_key: list[Any] = [None]


def record_graph(graph: GraphReport, key: Any = None) -> None:
    """Keep a compiled graph's report and log it (INFO). A report with the same ``key`` as the
    previous one (Dynamo restarted the analysis of that graph) replaces it."""
    with lock:
        if key is not None and last_key[0] == key and history:
            history[-1] = graph
        else:
            history.append(graph)
        last_key[0] = key
    logger.info("%s", graph.summary())
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s", graph.format(verbose=True))
