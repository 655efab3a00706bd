"""Execution traces of a session's calls, and what to do with one.

A :class:`Trace` (``session.start_trace()`` then ``stop_trace()``) holds one
:class:`CallRecord` per group call with one :class:`RankSpan` per rank and one
:class:`PullSpan` per piece of input a rank assembled, all on the driver's clock.
This package turns one into:

- a Chrome / Perfetto trace-event file (:func:`chrome_trace`,
  :func:`write_chrome_trace`) to browse in ``ui.perfetto.dev``;
- a timeline picture, one lane per rank (:func:`write_timeline_png`);
- numbers (:func:`summarise`): wall time, busy and idle time per pool, the longest
  dependency chain and the critical-path bound, plus :func:`check_spans` to catch
  inconsistent spans and :func:`markdown_table` for reports.

Nothing here imports Ray or torch: traces can be analysed offline.
"""

from __future__ import annotations

from asyncflow.tracing._analysis import TraceSummary, check_spans, markdown_table, summarise
from asyncflow.tracing._chrome import chrome_trace, write_chrome_trace
from asyncflow.tracing._records import CallRecord, PullSpan, RankSpan, Trace
from asyncflow.tracing._timeline import write_timeline_png

__all__ = [
    "CallRecord",
    "PullSpan",
    "RankSpan",
    "Trace",
    "TraceSummary",
    "check_spans",
    "chrome_trace",
    "markdown_table",
    "summarise",
    "write_chrome_trace",
    "write_timeline_png",
]
