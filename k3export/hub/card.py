"""The model card published with an artifact (``README.md``): YAML metadata the Hub indexes, usage, provenance from
``conversion.json`` and the validation table from ``validation.json`` (`build_model_card`); `check_model_card`
parses it with huggingface_hub's own card parser before anything is uploaded."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from k3export.artifacts import MODEL_FILE, ConversionRecord, HubError, ValidationReport
from k3export.artifacts.validation import meaningless
from k3export.units import format_bytes

from .detect import CARD_FILE, CHECKPOINT, Artifact

DEFAULT_BASE_MODEL = "moonshotai/Kimi-K3"


def _existing_card_license(root: Path) -> str | None:
    """The license the folder's own README declares (a source model's card), if any."""
    readme = root / CARD_FILE
    if not readme.is_file():
        return None
    from huggingface_hub import ModelCard

    try:
        card = ModelCard(readme.read_text(encoding="utf-8"), ignore_metadata_errors=True)
    except Exception:  # an unparsable README only loses its license hint
        return None
    value = getattr(card.data, "license", None)
    return value if isinstance(value, str) and value else None


def _fmt_float(value: float | None) -> str:
    if value is None:
        return "–"
    if value == 0:
        return "0"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if abs(value) >= 1e-3 and abs(value) < 1e4:
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return f"{value:.3e}"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def build_model_card(
    artifact: Artifact, repo_id: str | None, validation: ValidationReport | None, conversion: ConversionRecord | None
) -> str:
    """The README.md published with the artifact: YAML metadata, provenance and the validation table."""
    import yaml

    source = conversion.source if conversion is not None else None
    base_model = (source.repo_id if source is not None else None) or DEFAULT_BASE_MODEL
    license_ = _existing_card_license(artifact.root) or "other"

    fmt_tag = "safetensors" if artifact.kind == CHECKPOINT else "onnx"
    tags = ["k3export", "kimi-k3", fmt_tag]
    if artifact.kind == CHECKPOINT and any(f.path_in_repo == "modeling_k3.py" for f in artifact.files):
        tags.append("custom_code")
    meta: dict[str, Any] = {
        "library_name": "transformers" if artifact.kind == CHECKPOINT else "onnx",
        "license": license_,
    }
    if license_ == "other":
        meta["license_name"] = "source-model-license"
        meta["license_link"] = f"https://huggingface.co/{base_model}"
    meta.update({"base_model": base_model, "pipeline_tag": "text-generation", "tags": tags})
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip()

    title = repo_id.split("/")[-1] if repo_id else artifact.root.name
    what = "A converted checkpoint (safetensors)" if artifact.kind == CHECKPOINT else "An ONNX export"
    lines = [f"---\n{header}\n---", "", f"# {title}", ""]
    lines.append(
        f"{what} of [{base_model}](https://huggingface.co/{base_model}), produced with k3export. "
        "The license of the source model applies."
    )
    lines.append("")
    if artifact.kind == CHECKPOINT:
        target = repo_id or "<repo_id>"
        lines += [
            "## Usage",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{target}", trust_remote_code=True)',
            "```",
            "",
        ]
    else:
        lines += [
            "## Usage",
            "",
            "`model.onnx` (with its external data files) runs under ONNX Runtime; `runtime_config.json` and "
            "`state_manifest.json` describe the inputs, outputs and recurrent state the runtime has to carry.",
            "",
        ]

    if artifact.kind != CHECKPOINT and (artifact.root / MODEL_FILE).is_file():
        from k3export.info import export_bits_by_part

        lines += ["## Weights", "", "Bits per weight of each part as `model.onnx` stores it (quantized projections: "
                  "their codes and scales; MXFP4 experts: values and scales).", "",
                  "| Part | Parameters | Bytes | Bits per weight |", "|---|---:|---:|---:|"]
        for part, params, nbytes in export_bits_by_part(artifact.root / MODEL_FILE):
            bits = f"{8 * nbytes / params:.2f}" if params else "–"
            lines.append(f"| {part} | {params:,} | {format_bytes(nbytes)} | {bits} |")
        lines.append("")

    lines += ["## Conversion", ""]
    if conversion is None or source is None:
        lines += ["No `conversion.json` was found next to the artifact: the provenance is not recorded.", ""]
    else:
        lines.append(f"- Tool: {_md(conversion.tool)} {_md(conversion.tool_version)}")
        lines.append(f"- Created: {_md(conversion.created)}")
        if source.repo_id:
            rev = f" at revision `{_md(source.revision)}`" if source.revision else ""
            lines.append(f"- Source: `{_md(source.repo_id)}`{rev}")
        else:
            lines.append(f"- Source: local folder `{_md(source.name)}`")
        lines.append("")
        for label, rows in (("Source files", source.files), ("Outputs", conversion.outputs)):
            if rows:
                lines += [f"{label}:", "", "| File | Bytes | SHA-256 |", "|---|---:|---|"]
                lines += [f"| {_md(row.name)} | {row.bytes} | `{row.sha256}` |" for row in rows]
                lines.append("")
        if conversion.options:
            dump = json.dumps(conversion.options, indent=2, sort_keys=True)
            lines += ["Options:", "", "```json", dump, "```", ""]
        if conversion.skipped:
            lines += ["Skipped during conversion:", "", "```json", json.dumps(conversion.skipped, indent=2), "```", ""]

    lines += ["## Validation", ""]
    if validation is None:
        lines += ["**Not validated**: no `validation.json` was published with this artifact.", ""]
    else:
        verdict = "passed" if validation.passed else "**FAILED**"
        runtimes = ", ".join(validation.runtimes) or "–"
        reference = validation.reference + (f" computing in {validation.reference_dtype}"
                                             if validation.reference_dtype else "")
        if validation.runtime_dtypes:
            runtimes = ", ".join(f"{rt} in {dt}" for rt, dt in validation.runtime_dtypes.items()) + (
                ", each judged with the tolerances of its own dtype")
        lines.append(f"Cross-runtime validation {verdict} (reference: {_md(reference)}; runtimes: "
                     f"{_md(runtimes)}).")
        extra = [f"created {_md(validation.created)}", f"k3export {_md(validation.tool_version)}"]
        if validation.scenarios:
            extra.append("scenarios: " + ", ".join(_md(s) for s in validation.scenario_names))
        lines.append("Report " + "; ".join(extra) + ".")
        for runtime, reason in validation.skipped.items():
            lines.append(f"- Not run: {_md(runtime)} ({_md(reason)})")
        for kind, metrics in validation.tolerance_overrides.items():
            forced = any(meaningless(v) for v in metrics.values())
            lines.append(f"- Tolerance override: {_md(kind)} " + ", ".join(f"{k}={v:g}" for k, v in metrics.items())
                         + (" (**forced**: this tolerance passes any output, so this comparison means nothing)"
                            if forced else ""))
        if validation.localisation:
            lines += ["", "First divergence:", "", "```", validation.localisation, "```"]
        lines.append("")
        if validation.summary:
            lines += [
                "| Runtime | Scenario | Tensor | max abs | RMS rel | cosine | top-1 agree | greedy agree | Result |",
                "|---|---|---|---:|---:|---:|---:|---:|---|",
            ]
            for row in validation.summary:
                lines.append(
                    f"| {_md(row.runtime)} | {_md(row.scenario)} | {_md(row.tensor)} | "
                    f"{_fmt_float(row.max_abs)} | {_fmt_float(row.rms_rel)} | {_fmt_float(row.cosine)} | "
                    f"{_fmt_float(row.top1_agreement)} | {_fmt_float(row.greedy_agreement)} | "
                    f"{'pass' if row.passed else 'FAIL'} |"
                )
            lines.append("")

        if validation.quality:
            text = validation.model.get("quality_text")
            lines += [f"Next-token quality against the reference over {_md(text or 'a text')} "
                      "(`validate --quality`, docs/quality.md):", "",
                      "| Runtime | Tokens | PPL | PPL reference | ln(PPL/ref) | mean KLD | KLD p99 | KLD max | "
                      "top-1 agree | RMS Δp | Result |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for rt, q in validation.quality.items():
                lines.append(f"| {_md(rt)} | {q.tokens} | {_fmt_float(q.ppl)} | {_fmt_float(q.ppl_reference)} | "
                             f"{_fmt_float(q.ln_ppl_ratio)} | {_fmt_float(q.kld_mean)} | {_fmt_float(q.kld_p99)} | "
                             f"{_fmt_float(q.kld_max)} | {_fmt_float(q.top1_agree)} | {_fmt_float(q.delta_p_rms)} | "
                             f"{'pass' if q.passed else 'FAIL'} |")
            lines.append("")

    lines += ["## Files", "", "| File | Size |", "|---|---:|"]
    for f in artifact.files:
        lines.append(f"| {_md(f.path_in_repo)} | {format_bytes(f.size)} |")
    lines.append("")
    return "\n".join(lines)


def check_model_card(card: str) -> dict[str, Any]:
    """Parse ``card`` with huggingface_hub's own card parser (offline) and return its metadata."""
    from huggingface_hub import ModelCard

    try:
        parsed = ModelCard(card)
    except Exception as exc:  # ValueError for bad YAML, anything else from the parser
        raise HubError(f"generated model card does not parse: {exc}") from None
    data = parsed.data.to_dict()
    for key in ("library_name", "license", "base_model", "pipeline_tag", "tags"):
        if key not in data:
            raise HubError(f"generated model card lacks '{key}' metadata")
    return data


__all__ = ["DEFAULT_BASE_MODEL", "build_model_card", "check_model_card"]
