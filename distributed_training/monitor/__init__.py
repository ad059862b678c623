"""Monitoring for training runs: per-rank TensorBoard/JSONL logs, throughput, stragglers, GPU state.

`Monitor` records each step's metrics and timings, writing every `log_every` steps; `NullMonitor`
has the same methods and does nothing; `SystemStats` reads host and GPU figures on demand.
``python -m distributed_training.monitor.plot LOG_DIR -o run.png`` draws a run's curves.

Modules: `monitor` (`Monitor`), `null` (`NullMonitor`), `cluster` (the cross-rank step-time view and
the straggler check), `timings` (step-time sums), `writer` (the background writer thread and what it is
handed), `progress` (the progress bar), `system` (`SystemStats`), `plot`.
"""

from .monitor import Monitor, NullMonitor, StragglerWarning
from .system import SystemStats

__all__ = ["Monitor", "NullMonitor", "StragglerWarning", "SystemStats"]
