"""Nodes ONNX Runtime runs in one decode step of an export, by operator, from ORT's own profiler.

    python bench/ort_nodes.py EXPORT_DIR [EXPORT_DIR ...]          # prompt 64, then the second decode step
    python bench/ort_nodes.py DIR --top 20 --threads 2
    python bench/ort_nodes.py --openvino DIR                       # OpenVINO: OpenVinoRunner's compiled operations
    python bench/ort_nodes.py DIR --k3-ops both                    # with and without the k3 custom-op library

Every node the CPU provider executes in the step is counted (the nodes inside the branch an ``If`` takes as well
as the ``If`` itself), after ORT's graph optimisations: the figure that per-node overhead scales with. Kernel
times come from the profiler and are inflated by it; compare them only with each other. Not part of CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
from pathlib import Path



def decode_step_nodes(export: Path, threads: int, prompt: int,
                      k3_ops: bool = True) -> tuple[collections.Counter, collections.Counter]:
    """(nodes by operator, profiled microseconds by operator) of the second decode step after a `prompt`-token
    prefill of `export`'s model.onnx, run by k3export's ORT session (the export's session options; `k3_ops`: with
    the k3 custom-op library where it builds, `k3export.runtime.ort_ops`)."""
    import numpy as np

    from k3export.artifacts import load_export
    from k3export.runtime.ort_session import OrtSession

    exp = load_export(export)
    with tempfile.TemporaryDirectory(prefix="k3-ort-nodes-") as tmp:
        options = {**exp.runtime.session_options, "enable_profiling": True,
                   "profile_file_prefix": os.path.join(tmp, "profile")}
        session = OrtSession(exp.ort_form_path or exp.model_path, threads=threads, options=options, k3_ops=k3_ops)
        state = exp.manifest.initial_state(1)
        for past, ids in ((0, np.arange(3, 3 + prompt)), (prompt, [5]), (prompt + 1, [6])):
            feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, past + len(ids)), np.int64),
                     **state}
            out = session.run(feeds)
            state = {s.name: out[s.present] for s in exp.manifest.states}
        events = json.loads(Path(session.session.end_profiling()).read_text())
    last = [e for e in events if e.get("name") == "model_run"][-1]
    step = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
            and last["ts"] <= e["ts"] <= last["ts"] + last["dur"]]
    count, micros = collections.Counter(), collections.Counter()
    for e in step:
        count[e["args"]["op_name"]] += 1
        micros[e["args"]["op_name"]] += e["dur"]
    return count, micros


def openvino_nodes(export: Path) -> tuple[collections.Counter, str]:
    """Operations of `export`'s model as `OpenVinoRunner` compiles it for OpenVINO's CPU plugin (its runtime model;
    a graph without ``If`` runs each of them every call), by type, without parameters, results and constants; and
    the runner's description (the form, the k3 extension)."""
    from k3export.runtime.openvino_runner import OpenVinoRunner

    runner = OpenVinoRunner(export, threads=1)
    ops = runner.ov.compiled.get_runtime_model().get_ordered_ops()
    types = (op.get_rt_info()["layerType"].astype(str) for op in ops)
    return collections.Counter(t for t in types if t not in ("Parameter", "Result", "Const")), runner.describe()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("exports", nargs="+", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--openvino", action="store_true", help="count OpenVINO's compiled operations instead")
    p.add_argument("--k3-ops", choices=("on", "off", "both"), default="on",
                   help="ORT with the k3 custom-op library (on, where it builds), without it, or both")
    args = p.parse_args()
    for export in args.exports if args.openvino else ():
        count, how = openvino_nodes(export)
        print(f"\n{export}: {sum(count.values())} operations in OpenVINO's compiled model ({len(count)} types; {how})")
        print("| operation | count |")
        print("|---|---:|")
        for op, n in count.most_common(args.top):
            print(f"| {op} | {n} |")
    uses = {"on": (True,), "off": (False,), "both": (False, True)}[args.k3_ops]
    for export, use in ((e, u) for e in (() if args.openvino else args.exports) for u in uses):
        count, micros = decode_step_nodes(export, args.threads, args.prompt, use)
        print(f"\n{export} ({'with' if use else 'without'} the k3 ops library): {sum(count.values())} nodes in one decode step "
              f"({len(count)} operators, profiled kernel time {sum(micros.values()) / 1e3:.1f} ms)")
        print("| operator | nodes | profiled us |")
        print("|---|---:|---:|")
        for op, n in count.most_common(args.top):
            print(f"| {op} | {n} | {micros[op]} |")


if __name__ == "__main__":
    main()
