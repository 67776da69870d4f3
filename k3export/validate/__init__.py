"""Cross-runtime validation: scenarios, comparator, localisation, report + plot.

    from k3export.runtime import TorchRunner, OrtRunner
    from k3export.validate import make_scenarios, validate, to_json
    result = validate(TorchRunner(model), [OrtRunner(export_dir)], make_scenarios(config.vocab_size))
    report = to_json(result)          # schema: k3export.validate.report
    result.passed, result.localisation

`run_validation` (k3export.validate.api) is the one-call form the CLI uses.
"""

from __future__ import annotations

from .compare import DEFAULT_TOLERANCES, KINDS, Metrics, Tolerance, Tolerances, compare
from .core import RunResult, TensorRecord, ValidationResult, validate
from .localise import localise
from .report import SCHEMA_VERSION, check_schema, plot, read_json, render_table, to_json, write_json
from .scenarios import Scenario, load_prompts, make_scenarios

__all__ = [
    "DEFAULT_TOLERANCES", "KINDS", "SCHEMA_VERSION", "Metrics", "RunResult", "Scenario", "TensorRecord", "Tolerance",
    "Tolerances", "ValidationResult", "check_schema", "compare", "load_prompts", "localise", "make_scenarios", "plot",
    "read_json", "render_table", "to_json", "validate", "write_json",
]
