"""Cross-runtime validation: scenarios, comparator, localisation, report + plot.

    from k3export.runtime import TorchRunner, OrtRunner
    from k3export.validate import make_scenarios, validate, to_report
    result = validate(TorchRunner(model), [OrtRunner(export_dir)], make_scenarios(config.vocab_size))
    report = to_report(result)        # k3export.artifacts.ValidationReport; report.write(folder)
    result.passed, result.localisation

`state_scenarios` (prefix_reuse, multi_turn, fork, rollback) prove a kept, forked or rolled-back state equal to a
fresh recompute (``validate --state``). `run_validation` (k3export.validate.api) is the one-call form the CLI uses.
"""

from __future__ import annotations

from .compare import DEFAULT_TOLERANCES, KINDS, Metrics, Tolerance, Tolerances, compare
from .core import RunResult, TensorRecord, ValidationResult, validate
from .localise import localise
from .report import plot, read_report, render_table, to_report, write_report
from .scenarios import Scenario, load_prompts, make_scenarios
from .state_scenarios import STATE_SCENARIOS, state_scenarios

__all__ = [
    "DEFAULT_TOLERANCES", "KINDS", "Metrics", "RunResult", "STATE_SCENARIOS", "Scenario", "TensorRecord", "Tolerance",
    "Tolerances",
    "ValidationResult", "compare", "load_prompts", "localise", "make_scenarios", "plot", "read_report",
    "render_table", "state_scenarios", "to_report", "validate", "write_report",
]
