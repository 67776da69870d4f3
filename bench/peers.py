"""k3export against llama.cpp on the same weights: prefill and decode speed, peak RSS, greedy-token agreement and
next-token quality, with k3export's export on ONNX Runtime and on OpenVINO side by side.

    python bench/peers.py                       # prompts 64 and 512, 256 greedy steps, 2 threads, medians of 3
    python bench/peers.py --quick               # smoke run: prompt 64, 16 steps, 1 repetition
    python bench/peers.py --runtimes ort,llama-f32 --prompts 64 --steps 64 --json out.json
    python bench/peers.py --quick --runtimes ort,openvino,ort-mxfp4,openvino-mxfp4   # the two CPU runtimes only

Runtimes (``--runtimes``, default: all that can be built here):
  ort          the k3export ONNX export (fp32) on ONNX Runtime, driven by a generic loop over state_manifest.json
  ort-plain    the same export on a bare ``onnxruntime.InferenceSession(path)``: default session options, no k3
               library, what a user who never imports k3export gets
  ort-standard-plain  the ``--form standard`` export (KDA as ``LinearAttention-27`` + ``CausalConvWithState-27``) on
               a bare session: the portable form
  ort-ortform-plain  the ``--form ort`` export (KDA as ``com.microsoft::GatedDeltaNet``, MLA as ``Attention``) on a
               bare session
  ort-k3       the same export run by k3export's own `OrtRunner` (IO binding into reused state buffers), what
               ``k3export generate --runtime ort`` runs
  torch        k3export's PyTorch model, eager, with its own cache
  llama-f32    llama.cpp's own Kimi-K3 on an F32 GGUF (experts dequantised): the reference for ratios and tokens
  llama-mxfp4  llama.cpp on the GGUF converted from the released-layout folder with MXFP4 experts
  ort-mxfp4    the export with MXFP4 experts on ONNX Runtime (its lossless 8-bit form, docs/mxfp4.md)
  openvino     the same weights exported in the inlined graph form (``--form inlined``, the form OpenVINO
               reads) on OpenVINO's CPU plugin at fp32, driven by the same generic loop as ``ort``
  openvino-mxfp4  the MXFP4-expert export in the inlined form on OpenVINO (it dequantises the selected experts)
  openvino-k3  the inlined-form export run by k3export's own `OpenVinoRunner` in its stateful form (the carried
               state kept in the compiled model's variables), what ``k3export generate --runtime openvino`` runs
  openvino-k3-stateless  the same runner feeding and fetching every state each step (``--runtime
               openvino-stateless``): against ``openvino-k3``, what keeping the state inside OpenVINO is worth
  openvino-k3-ext  `OpenVinoRunner` (stateful) on the ``ort`` export itself (functions form): each k3 node one
               operation of k3export's OpenVINO extension library, what ``generate --runtime openvino`` runs on the
               export ``export`` writes by default
  openvino-mxfp4-ext  the same on the ``ort-mxfp4`` export: the extension's experts read their 4-bit bytes
  openvino-k3-ext-decode  ``openvino-k3-ext`` with its one-token steps on a second model compiled for one token
               (``--runtime openvino-decode-graph``)
  torch-f64    the PyTorch model in float64 (``model.double()``), run once per prompt: the tie-breaker for greedy
               tokens, where fp32 runtimes part at a near-tie (its speed is not compared)
  llama-q8_0, llama-q4_0  llama.cpp on the Q8_0 / Q4_0 GGUF its own quantizer (``llama_model_quantize``, what
               ``llama-quantize`` runs) makes from the F32 GGUF: what llama.cpp's CPU users run
  llama-mxfp4-moe  the same quantizer's MXFP4_MOE type: experts MXFP4, every other matrix Q8_0
  ort-nvfp4-ops  the MXFP4 folder cast to NVIDIA's NVFP4 layout (``convert --experts nvfp4``, bit-exact here) and
               exported with NVFP4 experts, on k3export's runner with the k3 ops library (its NVFP4 kernel)
  ort-int8-ops, ort-int4-ops  ``export --experts mxfp4 --quantize int8|int4`` (dense projections as
               ``MatMulNBits``) on k3export's runner with the k3 ops library; ratios against llama-q8_0 / llama-q4_0

The model is ``bench/big_cfg.json`` (a copy of ``../shared/bench/big_cfg.json``) applied over ``K3Config.tiny()``
(so every K3 feature is on, as in the released model), with ``randomize_weights`` and the routed experts rounded
to the MXFP4 grid, so the fp32 model, its ONNX export, the F32 GGUF and the MXFP4 GGUF all hold exactly the same
weights. ``--source DIR`` uses
a released-layout folder instead (its MXFP4 experts go straight to the MXFP4 GGUF). llama.cpp is fetched and
built on first use (``bench/llamacpp.py``, minutes), into ``$K3EXPORT_LLAMA_DIR`` or ``../llama``; artifacts go to
``--work-dir`` (default ``<llama dir>/peers``), outside the repository.

How it times (``../shared/spec/PEERS.md``): every measurement is its own subprocess (so its peak RSS is its
own, from ``wait4``), which reads its weight files once, loads, warms up on the full prompt, then times a
prefill of the prompt and ``--steps`` greedy decode steps. Runtimes are interleaved (A, B, C, C, B, A, ...) and
the median of ``--reps`` runs is reported. Then each runtime computes the logits of ``--quality-windows`` windows of
the repository's docs (one token a byte) in a subprocess of its own, and every row gets the quality figures of
``validate --quality`` (perplexity, KL divergence, top-1 agreement, delta-p; docs/quality.md) against the PyTorch
fp32 model's, with its bits per weight. Each run measures the CPU that other processes used meanwhile
(``/proc/stat`` busy time minus its own user+sys); a run above ``--max-outside`` cores is retried. The RSS
column "of it libraries" is the worker's RSS after importing what its loop imports, before any weight is
loaded (torch's loop imports torch and transformers; the MXFP4 ONNX Runtime loop imports
``k3export.converters.onnx.mxfp4``, which does not). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import llamacpp  # bench/llamacpp.py, beside this script (python puts its folder first on sys.path)

HERE = Path(__file__).resolve().parent
BIG_CFG = HERE / "big_cfg.json"  # the repository's copy of ../shared/bench/big_cfg.json
RUNTIMES: dict[str, tuple[str, str]] = {  # name -> (description, weights family for ratios)
    "ort": ("k3export ONNX export on ONNX Runtime", "f32"),
    "ort-k3": ("k3export ONNX export on k3export's ONNX Runtime runner (IO binding)", "f32"),
    "ort-plain": ("k3export ONNX export on a bare onnxruntime.InferenceSession (default options)", "f32"),
    "ort-standard-plain": ("the standard-form export (LinearAttention-27 etc.) on a bare InferenceSession", "f32"),
    "ort-ortform-plain": ("the ort-form export (GatedDeltaNet, Attention) on a bare InferenceSession", "f32"),
    "torch": ("k3export PyTorch eager", "f32"),
    "llama-f32": ("llama.cpp, F32 GGUF", "f32"),
    "llama-mxfp4": ("llama.cpp, MXFP4-expert GGUF", "mxfp4"),
    "ort-mxfp4": ("k3export MXFP4 export on ONNX Runtime", "mxfp4"),
    "openvino": ("k3export inlined-form ONNX export on OpenVINO", "f32"),
    "openvino-mxfp4": ("k3export inlined-form MXFP4 export on OpenVINO", "mxfp4"),
    "openvino-k3": ("k3export inlined-form export on k3export's OpenVINO runner (stateful)", "f32"),
    "openvino-k3-stateless": ("k3export inlined-form export on k3export's OpenVINO runner (stateless)", "f32"),
    "torch-f64": ("k3export PyTorch in float64 (greedy-token reference)", "f64"),
    "openvino-k3-ext": ("k3export functions-form export on k3export's OpenVINO runner with its k3 extension", "f32"),
    "openvino-mxfp4-ext": ("k3export MXFP4 functions-form export on OpenVINO with the k3 extension", "mxfp4"),
    "openvino-k3-ext-decode": ("openvino-k3-ext, its decode steps on a model compiled for one token", "f32"),
    # the same rows with the k3 custom-op library (K3EXPORT_ORT_OPS=1 in the worker's environment, 0 in the others')
    "ort-k3-ops": ("ort-k3 with K3EXPORT_ORT_OPS=1 (k3 custom-op library)", "f32"),
    "ort-mxfp4-ops": ("ort-mxfp4 with K3EXPORT_ORT_OPS=1 (k3 custom-op library, experts from their 4-bit bytes)",
                      "mxfp4"),
    # the precisions CPU users deploy: llama.cpp's own quantizations of the F32 GGUF, and `export --quantize`
    "llama-q8_0": ("llama.cpp, Q8_0 GGUF (its llama_model_quantize of the F32 GGUF)", "q8"),
    "llama-mxfp4-moe": ("llama.cpp, MXFP4_MOE GGUF (experts MXFP4, every other matrix Q8_0)", "q8"),
    "llama-q4_0": ("llama.cpp, Q4_0 GGUF (its llama_model_quantize of the F32 GGUF)", "q4"),
    "ort-nvfp4-ops": ("the MXFP4 folder cast to NVIDIA's NVFP4 layout (convert --experts nvfp4), exported with its "
                      "NVFP4 experts, on OrtRunner + k3 custom-op library", "mxfp4"),
    "ort-int8-ops": ("export --quantize int8, MXFP4 experts, on OrtRunner + k3 custom-op library", "q8"),
    "ort-int4-ops": ("export --quantize int4, MXFP4 experts, on OrtRunner + k3 custom-op library", "q4"),
}
BASELINE = {"f32": "llama-f32", "mxfp4": "llama-mxfp4", "q8": "llama-q8_0", "q4": "llama-q4_0"}
#: llama.cpp's quantized GGUFs: runtime -> `llamacpp.QUANT_TYPES` kind, each made from the F32 GGUF
LLAMA_QUANT = {"llama-q8_0": "q8_0", "llama-mxfp4-moe": "mxfp4_moe", "llama-q4_0": "q4_0"}
#: our quantized exports: input name -> `export --quantize`, each from the MXFP4-expert released-layout folder
ORT_QUANT = {"ort-int8": "int8", "ort-int4": "int4"}
#: the plain-session rows on an fp32 export of another graph form -> that form
PLAIN_FORMS = {"ort-standard-plain": "standard", "ort-ortform-plain": "ort"}
#: each OpenVINO row is also compared with ONNX Runtime on the same weights, measured in the same run
ORT_OF = {"openvino": "ort", "openvino-mxfp4": "ort-mxfp4", "ort-k3": "ort", "openvino-k3": "ort",
          "openvino-k3-stateless": "ort", "ort-k3-ops": "ort-k3", "ort-mxfp4-ops": "ort-mxfp4",
          "openvino-k3-ext": "ort-k3", "openvino-mxfp4-ext": "ort-mxfp4", "openvino-k3-ext-decode": "ort-k3",
          "ort-nvfp4-ops": "ort-mxfp4-ops", "ort-plain": "ort-k3-ops",
          **{rt: "ort-k3-ops" for rt in PLAIN_FORMS}}
#: the runtimes that read the inlined-form export
OPENVINO_F32 = ("openvino", "openvino-k3", "openvino-k3-stateless")
MiB = 2**20


# ====================================================================================== measurement primitives
def _proc_busy_seconds() -> float:
    """CPU time (all cores) the whole machine spent busy, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _self_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class OutsideLoad:
    """Cores used by other processes between `start` and `stop` (this process's own threads excluded)."""

    def start(self) -> None:
        self.t, self.busy, self.own = time.perf_counter(), _proc_busy_seconds(), _self_cpu_seconds()

    def stop(self) -> float:
        wall = time.perf_counter() - self.t
        other = (_proc_busy_seconds() - self.busy) - (_self_cpu_seconds() - self.own)
        return max(0.0, other) / max(wall, 1e-9)


def _vm_hwm_bytes(field: str = "VmHWM") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def import_libraries(rt: str, model: Path) -> None:
    """Import what the runtime's loop imports before it loads weights, so the RSS that follows is the model's."""
    if rt.startswith("ort"):
        import onnxruntime  # noqa: F401

        if "FLOAT4E2M1" in _initializer_types(model):
            import k3export.converters.onnx.mxfp4  # noqa: F401
        if rt.startswith("ort-k3"):
            import k3export.runtime.ort_runner  # noqa: F401
    elif rt.startswith("openvino"):
        import openvino  # noqa: F401

        import k3export.runtime.openvino_session  # noqa: F401

        if rt.startswith("openvino-k3") or rt.endswith("-ext"):
            import k3export.runtime.openvino_runner  # noqa: F401
    elif rt == "torch":
        import k3export.modeling  # noqa: F401


def read_files_once(paths: list[Path]) -> int:
    """Read every file through the page cache (not mapped, so it adds nothing to RSS): the VM pages cold file
    pages out after about a minute, and every runtime here maps its weights."""
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def _files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


# ============================================================================================ runtime runners
class OrtRunner:
    """A generic greedy loop over an ONNX export, driven by whatever its state manifest says.

    States are read tolerantly: each entry's name (``name``), its output (``present``, else a name guessed from
    the session's outputs), shape and dtype (else the session's own). Symbolic dimensions start at 1 for the
    batch (the first dimension, or one whose name says batch) and 0 otherwise (past lengths)."""

    def __init__(self, export_dir: Path, threads: int, plain: bool = False) -> None:
        import numpy as np

        self.np = np
        self.plain = plain
        cfg = _read_json(export_dir / "runtime_config.json")
        manifest = _read_json(export_dir / str(cfg.get("manifest_file") or "state_manifest.json"))
        model = export_dir / str(cfg.get("model_file") or "model.onnx")
        if not model.is_file():
            model = next(iter(sorted(export_dir.glob("*.onnx"))))
        self.sess = self._session(model, cfg, threads)
        inputs = {i.name: i for i in self.sess.get_inputs()}
        outputs = [o.name for o in self.sess.get_outputs()]
        self.logits_name = "logits" if "logits" in outputs else outputs[0]
        self.ids_dtype = np.int32 if "int32" in inputs["input_ids"].type else np.int64
        # an optional input keeping only the last logits (as llama.cpp and the torch runner compute them)
        self.keep = next((i.name for i in self.sess.get_overridable_initializers() if i.name == "logits_to_keep"), None)
        self.mask_name = "attention_mask" if "attention_mask" in inputs else None
        self.pos_name = "position_ids" if "position_ids" in inputs else None
        self.states = self._states(manifest, inputs, outputs)
        known = {"input_ids", self.mask_name, self.pos_name} | {s[0] for s in self.states}
        unknown = sorted(set(inputs) - known)
        if unknown:
            raise RuntimeError(f"{model}: inputs this loop does not know how to feed: {unknown}")
        self.out_names = [self.logits_name] + [s[1] for s in self.states]
        self.reset()

    def _session(self, model: Path, cfg: dict, threads: int) -> Any:
        """An ONNX Runtime CPU session of `model`, with the session options the export recommends."""
        import onnxruntime as ort

        if self.plain:  # what a user without k3export runs: every option ORT's default (threads: all cores)
            return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        so = ort.SessionOptions()
        for key, value in (cfg.get("session_options") or {}).items():  # options an export may recommend
            if key not in ("intra_op_num_threads", "inter_op_num_threads") and hasattr(so, key):
                setattr(so, key, value)
        for key, value in (cfg.get("session_config_entries") or {}).items():
            so.add_session_config_entry(str(key), str(value))
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        if "FLOAT4E2M1" in _initializer_types(model):  # MXFP4 experts: the 8-bit form ORT's CPU provider runs
            from k3export.runtime.ort_session import ort_session

            # the k3 ops library's kernels (unless K3EXPORT_ORT_OPS=0), MXFP4 experts read from their own 4-bit bytes
            import onnx

            from k3export.runtime import ort_ops

            k3 = ort_ops.used(onnx.load(str(model), load_external_data=False)) and ort_ops.register(so)
            self.k3_ops = k3
            return ort_session(model, so, ["CPUExecutionProvider"], k3_ops=k3)
        return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])

    def _states(self, manifest: dict, inputs: dict, outputs: list[str]) -> list[tuple[str, str, Any]]:
        np = self.np
        entries = manifest.get("states") or manifest.get("state") or []
        if isinstance(entries, dict):  # {name: spec}
            entries = [dict(v, name=k) if isinstance(v, dict) else {"name": k} for k, v in entries.items()]
        specs = [e for e in entries if isinstance(e, dict) and (e.get("name") or e.get("input")) in inputs]
        if not specs:  # no usable manifest: every extra input is a state
            specs = [{"name": n} for n in inputs if n not in ("input_ids", "attention_mask", "position_ids")]
        rest = [o for o in outputs if o != self.logits_name]
        states = []
        for i, e in enumerate(specs):
            name = e.get("name") or e.get("input")
            present = e.get("present") or e.get("output")
            if present not in outputs:
                guesses = [name.replace("past_key_values", "present"), name.replace("past", "present")]
                present = next((g for g in guesses if g in outputs), rest[i] if i < len(rest) else None)
            if present is None:
                raise RuntimeError(f"no output found for state {name!r}")
            shape = e.get("shape") or inputs[name].shape
            dims = [d if isinstance(d, int) else (1 if j == 0 or "batch" in str(d).lower() else 0)
                    for j, d in enumerate(shape)]
            dtype = _np_dtype(e.get("dtype") or inputs[name].type)
            states.append((name, present, np.zeros(dims, dtype)))
        return states

    def reset(self) -> None:
        self.state = {name: init for name, _, init in self.states}
        self.past = 0

    def _run(self, tokens: list[int], keep: int = 1) -> Any:
        """Run `tokens` on from the current state; the logits [1, n or `keep`, vocab] (`keep` 0: every position)."""
        np = self.np
        n = len(tokens)
        feeds = {"input_ids": np.asarray([tokens], self.ids_dtype), **self.state}
        if self.mask_name:
            feeds[self.mask_name] = np.ones((1, self.past + n), np.int64)
        if self.pos_name:
            feeds[self.pos_name] = np.arange(self.past, self.past + n, dtype=np.int64)[None]
        if self.keep:
            feeds[self.keep] = np.array(keep, np.int64)
        outs = self.sess.run(self.out_names, feeds)
        self.state = {name: out for (name, _, _), out in zip(self.states, outs[1:])}
        self.past += n
        return outs[0]

    def logits(self, tokens: list[int]) -> Any:
        """[n, vocab]: the logits at every position of `tokens`, from an empty state."""
        self.reset()
        return self._run(tokens, keep=0)[0]

    def prefill(self, tokens: list[int]) -> int:
        return int(self._run(tokens)[0, -1].argmax())

    def step(self, token: int) -> int:
        return int(self._run([token])[0, -1].argmax())



class K3OrtRunner:
    """k3export's own ONNX Runtime runner (`k3export.runtime.ort_runner.OrtRunner`: the export's session options,
    IO binding) behind the loop's calls."""

    def __init__(self, export_dir: Path, threads: int) -> None:
        from k3export.runtime.loop import Decoding, next_tokens
        from k3export.runtime.ort_runner import OrtRunner as LibraryRunner

        self.runner = LibraryRunner(export_dir, threads=threads)
        self.runner.logits_to_keep = 1
        self.k3_ops = self.runner.ort.k3_ops
        self._decoding, self._next = Decoding, next_tokens
        self.reset()

    def reset(self) -> None:
        self.decoding = self._decoding(self.runner)

    def logits(self, tokens: list[int]) -> Any:
        """[n, vocab]: the logits at every position of `tokens`, from an empty state."""
        from k3export.runtime.base import to_numpy

        self.runner.logits_to_keep = 0
        try:
            return to_numpy(self._decoding(self.runner).feed([tokens]).logits)[0]
        finally:
            self.runner.logits_to_keep = 1

    def prefill(self, tokens: list[int]) -> int:
        return int(self._next(self.decoding.feed([tokens]))[0])

    def step(self, token: int) -> int:
        return int(self._next(self.decoding.feed([[token]]))[0])


class K3OpenVinoRunner(K3OrtRunner):
    """k3export's own OpenVINO runner (`k3export.runtime.openvino_runner.OpenVinoRunner`), stateful or not, behind
    the loop's calls."""

    def __init__(self, export_dir: Path, threads: int, stateful: bool, decode_graph: bool = False) -> None:
        from k3export.runtime.loop import Decoding, next_tokens
        from k3export.runtime.openvino_runner import OpenVinoRunner as LibraryRunner

        self.runner = LibraryRunner(export_dir, threads=threads, stateful=stateful, decode_graph=decode_graph)
        assert self.runner.stateful == stateful, self.runner.ov.stateless_reason
        self.runner.logits_to_keep = 1
        self.k3_ops = self.runner.k3_ext
        self._decoding, self._next = Decoding, next_tokens
        self.reset()


class OpenVinoRunner(OrtRunner):
    """The same generic loop over an inlined-form export, on OpenVINO's CPU plugin (`_OpenVinoSession`)."""

    def _session(self, model: Path, cfg: dict, threads: int) -> Any:
        return _OpenVinoSession(model, threads)


class _OpenVinoSession:
    """k3export's OpenVINO session (fp32 inference precision, optional ``logits_to_keep``) behind the calls the
    loop makes of an ONNX Runtime session; input names, types and shapes as the ONNX file declares them."""

    _TYPES = {"FLOAT": "float", "FLOAT16": "float16", "BFLOAT16": "bfloat16", "INT64": "int64", "INT32": "int32"}

    def __init__(self, model: Path, threads: int) -> None:
        from types import SimpleNamespace

        import onnx

        from k3export.runtime.openvino_session import OpenVinoSession

        self.session = OpenVinoSession(model, threads=threads)
        graph = onnx.load(str(model), load_external_data=False).graph

        def spec(v: Any) -> Any:
            t = v.type.tensor_type
            name = onnx.TensorProto.DataType.Name(t.elem_type)
            return SimpleNamespace(name=v.name, type=f"tensor({self._TYPES.get(name, name.lower())})",
                                   shape=[d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim])

        optional = set(self.session.optional_inputs)
        self._inputs = [spec(v) for v in graph.input if v.name not in optional]
        self._optional = [SimpleNamespace(name=n) for n in self.session.optional_inputs]
        self._outputs = [spec(v) for v in graph.output]

    def get_inputs(self) -> list[Any]:
        return self._inputs

    def get_outputs(self) -> list[Any]:
        return self._outputs

    def get_overridable_initializers(self) -> list[Any]:
        return self._optional

    def run(self, names: list[str], feeds: dict[str, Any]) -> list[Any]:
        out = self.session.run(feeds)
        return [out[n] for n in names]


class TorchRunner:
    def __init__(self, model_dir: Path, threads: int, float64: bool = False) -> None:
        import inspect

        import torch

        from k3export import K3ForCausalLM  # as a user gets it: with k3export's kernels plugged in

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = K3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        if float64:
            self.model.double()
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.reset()

    def reset(self) -> None:
        self.cache = None

    def _run(self, tokens: list[int]) -> int:
        torch = self.torch
        with torch.inference_mode():
            kw = {self.cache_kw: self.cache} if self.cache is not None else {}
            out = self.model(input_ids=torch.tensor([tokens]), use_cache=True, **kw, **self.extra)
        self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return int(out.logits[0, -1].argmax())

    def logits(self, tokens: list[int]) -> Any:
        """[n, vocab] float32: the logits at every position of `tokens`, from an empty cache."""
        with self.torch.inference_mode():
            return self.model(input_ids=self.torch.tensor([tokens])).logits[0].float().numpy()

    def prefill(self, tokens: list[int]) -> int:
        return self._run(tokens)

    def step(self, token: int) -> int:
        return self._run([token])


def _initializer_types(model: Path) -> set[str]:
    """ONNX type names of the model's initializers, read without its external data."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    return {onnx.TensorProto.DataType.Name(t.data_type) for t in proto.graph.initializer}


def _np_dtype(name: str) -> Any:
    import numpy as np

    s = str(name).lower().replace("tensor(", "").rstrip(")")
    return {"float": np.float32, "float32": np.float32, "fp32": np.float32, "float16": np.float16,
            "fp16": np.float16, "int64": np.int64, "int32": np.int32}.get(s, np.float32)


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


# ================================================================================================== worker
def make_runner(rt: str, path: Path, threads: int, llama_root: str, n_ctx: int, n_batch: int) -> Any:
    """Runtime `rt`'s runner of its input `path` (llama.cpp's context made for `n_ctx` tokens, `n_batch` a call)."""
    if rt in ("ort", "ort-mxfp4", "ort-mxfp4-ops", "ort-plain", *PLAIN_FORMS):
        return OrtRunner(path, threads, plain=rt.endswith("-plain"))
    if rt in ("ort-k3", "ort-k3-ops", "ort-nvfp4-ops", "ort-int8-ops", "ort-int4-ops"):
        return K3OrtRunner(path, threads)
    if rt in ("openvino", "openvino-mxfp4"):
        return OpenVinoRunner(path, threads)
    if rt in ("openvino-k3", "openvino-k3-stateless", "openvino-k3-ext", "openvino-mxfp4-ext",
              "openvino-k3-ext-decode"):
        runner = K3OpenVinoRunner(path, threads, stateful=rt != "openvino-k3-stateless",
                                  decode_graph=rt == "openvino-k3-ext-decode")
        if "-ext" in rt and not runner.k3_ops:
            raise SystemExit(f"{rt}: the OpenVINO k3 extension is not used here")
        return runner
    if rt in ("torch", "torch-f64"):
        return TorchRunner(path, threads, float64=rt == "torch-f64")
    return llamacpp.LlamaCppRunner(Path(llama_root), path, threads, n_ctx=n_ctx, n_batch=n_batch)


def quality_worker(args: argparse.Namespace) -> None:
    """The next-token logits of one runtime over the quality windows, each from an empty state: the positions
    after the window's first half but the last (what `validate --quality` scores), saved for the parent."""
    work = Path(args.work_dir)
    art = _with_readers(json.loads((work / "artifacts.json").read_text()))
    wins = np.load(work / "quality" / "windows.npy")
    context = wins.shape[1]
    path = Path(art["paths"][args.worker])
    read_files_once([path] if path.is_file() else _files_under(path))
    runner = make_runner(args.worker, path, args.threads, art["llama_root"], n_ctx=context, n_batch=context)
    out = []
    for ids in wins:
        logits = np.asarray(runner.logits([int(t) for t in ids]), np.float32)
        if logits.shape[0] != context:
            raise SystemExit(f"{args.worker}: logits of {logits.shape[0]} positions for a window of {context}")
        out.append(logits[context // 2:-1])
    np.save(work / "quality" / f"{args.worker}.npy", np.stack(out))


def worker(args: argparse.Namespace) -> None:
    """One measurement of one runtime, in its own process; prints one JSON line."""
    work = Path(args.work_dir)
    art = _with_readers(json.loads((work / "artifacts.json").read_text()))
    prompt = json.loads((work / "prompts.json").read_text())[str(args.prompt_len)]
    rt = args.worker
    path = Path(art["paths"][rt])
    files = [path] if path.is_file() else _files_under(path)
    t0 = time.perf_counter()
    nbytes = read_files_once(files)
    t1 = time.perf_counter()
    import_libraries(rt, path / "model.onnx" if path.is_dir() else path)
    rss_libs = _vm_hwm_bytes("VmRSS")
    runner = make_runner(rt, path, args.threads, art["llama_root"],
                         n_ctx=len(prompt) + args.steps + args.warm_steps + 8, n_batch=len(prompt))
    t2 = time.perf_counter()

    # warm-up on the full prompt (and a few steps), then start again from an empty state
    tok = runner.prefill(prompt)
    for _ in range(args.warm_steps):
        tok = runner.step(tok)
    runner.reset()
    t3 = time.perf_counter()

    load = OutsideLoad()
    load.start()
    ts = time.perf_counter()
    tokens = [runner.prefill(prompt)]
    tp = time.perf_counter()
    for _ in range(args.steps):
        tokens.append(runner.step(tokens[-1]))
    td = time.perf_counter()
    outside = load.stop()
    print(json.dumps({
        "runtime": rt, "prompt_len": len(prompt), "steps": args.steps, "threads": args.threads,
        "prefill_s": tp - ts, "decode_s": td - tp,
        "prefill_tok_s": len(prompt) / (tp - ts), "decode_tok_s": args.steps / (td - tp) if args.steps else None,
        "outside_cores": outside, "vm_hwm": _vm_hwm_bytes(), "rss_libs": rss_libs, "tokens": tokens,
        "read_bytes": nbytes, "read_s": t1 - t0, "load_s": t2 - t1, "warm_s": t3 - t2,
        "k3_ops": getattr(runner, "k3_ops", None),  # whether a native k3 library ran (ORT's or OpenVINO's)
    }), flush=True)


# ================================================================================================ artifacts
def bench_config(path: Path) -> Any:
    """big_cfg.json over `K3Config.tiny()`: the file's sizes, every other K3 feature as released (situ,
    full-rank KDA gate, MLA output gate, shared experts, latent MoE, Attention Residuals)."""
    from k3export.modeling import K3Config

    over = json.loads(path.read_text())
    lac = dict(K3Config.tiny().linear_attn_config)
    lac.update(over.get("linear_attn_config") or {})
    return K3Config.tiny(**{**over, "linear_attn_config": lac})


def _fresh(d: Path) -> Path:
    if d.exists():
        shutil.rmtree(d) if d.is_dir() else d.unlink()
    return d


def _step(msg: str, t: float) -> None:
    print(f"  {msg} ({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)


#: the fp32 exports' folders under the work folder, by graph form
FP32_EXPORTS = {"functions": "onnx", "standard": "onnx_standard", "inlined": "onnx_inlined", "ort": "onnx_ortform"}


def export_fp32(work: Path, form: str = "functions", model: Any = None) -> str:
    """The fp32 export in graph `form` of the weights in ``work/k3`` (or of `model`) into its `FP32_EXPORTS` folder:
    its path."""
    import torch

    from k3export.converters.onnx import export_onnx
    from k3export.modeling import K3ForCausalLM

    t = time.perf_counter()
    if model is None:
        model = K3ForCausalLM.from_pretrained(str(work / "k3"), dtype=torch.float32).eval()
    out = work / FP32_EXPORTS[form]
    export_onnx(model, _fresh(out), dtype="fp32", form=form)
    _step(f"export_onnx(fp32, form={form!r}) -> {out.name}/", t)
    return str(out)


def export_ort_mxfp4(work: Path, source: Path, form: str | None = None) -> str:
    """The export with MXFP4 experts of a released-layout folder into ``work/onnx_mxfp4`` (a graph `form`:
    ``work/onnx_mxfp4_<form>``): its path."""
    from k3export.converters.onnx import export_onnx

    t = time.perf_counter()
    out = work / ("onnx_mxfp4" if form is None else f"onnx_mxfp4_{form}")
    export_onnx(str(source), _fresh(out), dtype="fp32", experts="mxfp4", **({} if form is None else {"form": form}))
    _step(f"export_onnx(experts='mxfp4'{'' if form is None else f', form={form!r}'}) -> {out.name}/", t)
    return str(out)


def export_ort_quant(work: Path, source: Path, quantize: str) -> str:
    """``export --experts mxfp4 --quantize <quantize>`` of a released-layout folder into ``work/onnx_<quantize>``."""
    from k3export.converters.onnx import export_onnx

    t = time.perf_counter()
    out = work / f"onnx_{quantize}"
    export_onnx(str(source), _fresh(out), dtype="fp32", experts="mxfp4", quantize=quantize)
    _step(f"export_onnx(experts='mxfp4', quantize={quantize!r}) -> {out.name}/", t)
    return str(out)


def export_ort_nvfp4(work: Path, source: Path) -> str:
    """The MXFP4 released-layout folder cast to the NVFP4 layout (``convert --experts nvfp4 --dtype fp32``) in
    ``work/released_nvfp4``, exported with its NVFP4 experts into ``work/onnx_nvfp4``."""
    from k3export.converters.checkpoints.convert import convert
    from k3export.converters.onnx import export_onnx

    t = time.perf_counter()
    folder = work / "released_nvfp4"
    convert(source, _fresh(folder), dtype="fp32", experts="nvfp4")
    export_onnx(str(folder), _fresh(work / "onnx_nvfp4"), dtype="fp32", experts="nvfp4")
    _step("convert(experts='nvfp4') -> released_nvfp4/, export_onnx(experts='nvfp4') -> onnx_nvfp4/", t)
    return str(work / "onnx_nvfp4")


#: the runtimes whose input is an export, redone on every run (the export is what is under development)
EXPORTED = ("ort", "ort-mxfp4", "openvino", "openvino-mxfp4", "openvino-k3", "openvino-k3-stateless", "ort-nvfp4",
            *PLAIN_FORMS, *ORT_QUANT)


def build_artifacts(args: argparse.Namespace, runtimes: list[str]) -> dict[str, Any]:
    """Write every runtime's input from one set of weights; return {paths, notes, ...} (also artifacts.json)."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    index = work / "artifacts.json"
    if args.reuse and index.is_file():
        art = _with_readers(json.loads(index.read_text()))
        wanted = [rt for rt in _inputs(runtimes) if rt not in art.get("notes", {}) and rt not in EXPORTED]
        if "vocab_size" in art and (work / "k3").is_dir() and all(
                rt in art["paths"] and Path(art["paths"][rt]).exists() for rt in wanted):
            print(f"reusing the weights and GGUFs in {work}", file=sys.stderr)
            read = _inputs(runtimes).__contains__  # whether a row asked for reads that export
            if read("ort"):  # the export is what is under development: always redo it
                art["paths"]["ort"] = export_fp32(work)
            if read("openvino"):
                art["paths"]["openvino"] = export_fp32(work, "inlined")
            for rt, form in PLAIN_FORMS.items():
                if read(rt):
                    art["paths"][rt] = export_fp32(work, form)
            mx_src = art.get("mxfp4_source")
            for rt, form in (("ort-mxfp4", None), ("openvino-mxfp4", "inlined")):
                if read(rt) and mx_src:
                    art["notes"].pop(rt, None)
                    art["paths"][rt] = export_ort_mxfp4(work, Path(mx_src), form)
            for rt, q in ORT_QUANT.items():
                if read(rt) and mx_src:
                    art["paths"][rt] = export_ort_quant(work, Path(mx_src), q)
            if read("ort-nvfp4") and mx_src:
                art["paths"]["ort-nvfp4"] = export_ort_nvfp4(work, Path(mx_src))
            if any(read(rt) for rt in EXPORTED):
                index.write_text(json.dumps(art, indent=1) + "\n")
            return _with_readers(art)

    import torch

    from k3export.modeling import K3ForCausalLM, randomize_weights

    torch.set_num_threads(os.cpu_count() or 2)
    paths: dict[str, str] = {}
    notes: dict[str, str] = {}
    print(f"writing artifacts into {work}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    mxfp4_source: Path | None = None
    if args.source:
        src = Path(args.source)
        model = K3ForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
        packs = None
        q = _read_json(src / "config.json").get("quantization_config") or {}
        if q.get("format") == "mxfp4-pack-quantized":
            mxfp4_source = src
        else:
            for rt in ("llama-mxfp4", "ort-mxfp4", "openvino-mxfp4", "ort-nvfp4", *ORT_QUANT):
                notes[rt] = f"{src} has no MXFP4 experts"
        what = f"loaded {src}"
    else:
        model = K3ForCausalLM(bench_config(Path(args.config))).eval()
        randomize_weights(model, args.seed)
        packs = llamacpp.snap_experts_to_mxfp4(model)
        what = f"random weights (seed {args.seed}), experts on the MXFP4 grid"
    n_params = sum(p.numel() for p in model.parameters())
    config_vocab = model.config.vocab_size
    _step(f"{what}: {n_params / 1e6:.1f}M parameters", t)

    t = time.perf_counter()
    model.save_pretrained(str(_fresh(work / "k3")))  # the torch runtime's input, and the weights --reuse keeps
    paths["torch"] = str(work / "k3")
    _step("torch: save_pretrained -> k3/", t)
    inputs = _inputs(runtimes)
    if "ort" in inputs:
        paths["ort"] = export_fp32(work, "functions", model)
    if "openvino" in inputs:
        paths["openvino"] = export_fp32(work, "inlined", model)
    for rt, form in PLAIN_FORMS.items():
        if rt in inputs:
            paths[rt] = export_fp32(work, form, model)
    root = Path(args.llama_dir)
    if "llama-f32" in runtimes or set(LLAMA_QUANT) & inputs:
        t = time.perf_counter()
        llamacpp.write_released(model, _fresh(work / "released_f32"))
        paths["llama-f32"] = str(llamacpp.convert(root, work / "released_f32", work / "gguf" / "f32.gguf", "f32"))
        _step("llama-f32: released layout (experts dequantised) -> gguf/f32.gguf", t)
    for rt, kind in LLAMA_QUANT.items():
        if rt in inputs:
            t = time.perf_counter()
            out = work / "gguf" / f"{kind}.gguf"
            paths[rt] = str(llamacpp.quantize(root, Path(paths["llama-f32"]), out, kind, args.threads))
            _step(f"{rt}: llama_model_quantize(f32.gguf, {kind}) -> gguf/{out.name}", t)
    if packs is not None and {"llama-mxfp4", "ort-mxfp4", "openvino-mxfp4", "ort-nvfp4", *ORT_QUANT} & inputs:
        t = time.perf_counter()
        mxfp4_source = llamacpp.write_released(model, _fresh(work / "released_mxfp4"), packs)
        _step("released layout with MXFP4 experts -> released_mxfp4/", t)
    if "llama-mxfp4" in runtimes and mxfp4_source is not None:
        t = time.perf_counter()
        paths["llama-mxfp4"] = str(llamacpp.convert(root, mxfp4_source, work / "gguf" / "mxfp4.gguf", "f32"))
        _step("llama-mxfp4: -> gguf/mxfp4.gguf (dense F32, experts MXFP4)", t)
    if "ort-mxfp4" in inputs and mxfp4_source is not None:
        paths["ort-mxfp4"] = export_ort_mxfp4(work, mxfp4_source)
    if "openvino-mxfp4" in inputs and mxfp4_source is not None:
        paths["openvino-mxfp4"] = export_ort_mxfp4(work, mxfp4_source, "inlined")
    for rt, q in ORT_QUANT.items():
        if rt in inputs and mxfp4_source is not None:
            paths[rt] = export_ort_quant(work, mxfp4_source, q)
    if "ort-nvfp4" in inputs and mxfp4_source is not None:
        paths["ort-nvfp4"] = export_ort_nvfp4(work, mxfp4_source)
    del model
    art = {"paths": paths, "notes": notes, "llama_root": str(root), "n_params": n_params,
           "vocab_size": config_vocab, "mxfp4_source": str(mxfp4_source) if mxfp4_source else None,
           "source": str(args.source or args.config), "seed": args.seed,
           "sizes": {rt: sum(f.stat().st_size for f in ([Path(p)] if Path(p).is_file() else _files_under(Path(p))))
                     for rt, p in paths.items()}}
    index.write_text(json.dumps(art, indent=1) + "\n")
    return _with_readers(art)


#: the runtimes that read another runtime's input (the same export or weights, run another way) -> that runtime
READS = {"torch-f64": "torch", "ort-k3": "ort", "ort-plain": "ort", "ort-k3-ops": "ort", "openvino-k3-ext": "ort",
         "openvino-k3-ext-decode": "ort", "ort-mxfp4-ops": "ort-mxfp4", "openvino-mxfp4-ext": "ort-mxfp4",
         "ort-int8-ops": "ort-int8", "ort-int4-ops": "ort-int4", "ort-nvfp4-ops": "ort-nvfp4",
         **{rt: "openvino" for rt in OPENVINO_F32[1:]}}


def _inputs(runtimes: list[str]) -> set[str]:
    """The runtimes whose inputs `runtimes` read: each, or the one it reads (`READS`)."""
    return {READS.get(rt, rt) for rt in runtimes}


def _with_readers(art: dict[str, Any]) -> dict[str, Any]:
    """`art` with the path of every runtime of `READS` whose input was written."""
    for rt, source in READS.items():
        if source in art["paths"]:
            art["paths"].setdefault(rt, art["paths"][source])
    return art


# ================================================================================================== driver
def run_worker(args: argparse.Namespace, rt: str, prompt_len: int, quality: bool = False) -> dict[str, Any]:
    """Run one measurement (or, `quality`, one runtime's quality logits) in a subprocess. Its peak RSS is the
    worker's own VmHWM: wait4's ru_maxrss would also count the pages of this (forked) parent, which Linux keeps in
    the high-water mark across exec."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", rt, "--work-dir", str(args.work_dir),
           "--prompt-len", str(prompt_len), "--steps", str(args.steps), "--threads", str(args.threads),
           "--warm-steps", str(args.warm_steps), *(["--quality-worker"] if quality else [])]
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    env["K3EXPORT_ORT_OPS"] = "1" if rt.endswith("-ops") else "0"  # the other ONNX Runtime rows: the function bodies
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"runtime": rt, "error": f"timed out after {args.timeout:.0f} s"}
    if p.returncode != 0:
        return {"runtime": rt, "error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1],
                "stderr": p.stderr[-3000:]}
    if quality:
        return {"runtime": rt}
    r = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    r["peak_rss"] = r["vm_hwm"]
    return r


def docs_tokens() -> np.ndarray:
    """The quality token stream: the repository's README and docs, one token a UTF-8 byte (ids 3..258; a random
    model has no tokenizer worth the name, and any fixed stream read alike by every runtime will do)."""
    root = HERE.parent
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64) + 3


def weight_bits(path: Path, n_params: int) -> float:
    """Bits a parameter of the weight files of a runtime's input: a GGUF, or a folder's safetensors and ONNX files
    (graph and external data; tokenizer and JSON files left out)."""
    files = [path] if path.is_file() else [f for f in _files_under(path) if f.suffix in (".safetensors", ".onnx")
                                           or ".onnx.data" in f.name or f.suffix == ".data"]
    return 8 * sum(f.stat().st_size for f in files) / n_params


def quality_pass(args: argparse.Namespace, art: dict[str, Any], runtimes: list[str]) -> dict[str, dict[str, Any]]:
    """Every runtime's next-token quality against PyTorch fp32 (``torch``) over the same windows of
    `docs_tokens`, each window from an empty state and its second half scored (`k3export.validate.quality`):
    {runtime: figures, or {"error": ...}}. Each runtime's logits come from its own subprocess."""
    from k3export.validate.quality import score_tokens, summarise
    from k3export.validate.text_quality import windows

    qdir = Path(args.work_dir) / "quality"
    qdir.mkdir(exist_ok=True)
    wins = windows(docs_tokens(), args.quality_context)[: args.quality_windows]
    np.save(qdir / "windows.npy", wins)
    first = wins.shape[1] // 2
    position = np.arange(wins.shape[1] - 1 - first)
    logits: dict[str, Any] = {}
    for rt in ["torch", *(r for r in runtimes if r != "torch")]:
        t = time.perf_counter()
        r = run_worker(args, rt, 0, quality=True)
        logits[rt] = r if "error" in r else np.load(qdir / f"{rt}.npy")
        _step(f"quality logits of {rt}: {r.get('error', 'done')}", t)
    ref = logits["torch"]
    if isinstance(ref, dict):
        return {rt: {"error": f"the reference failed: {ref['error']}"} for rt in runtimes}
    out: dict[str, dict[str, Any]] = {}
    for rt in runtimes:
        if isinstance(logits[rt], dict):
            out[rt] = logits[rt]
            continue
        parts = [score_tokens(logits[rt][w], ref[w], wins[w, first + 1:], position) for w in range(len(wins))]
        figures = summarise(parts).to_dict()
        figures.pop("kld_by_position")
        figures["bits_per_weight"] = weight_bits(Path(art["paths"][rt]), art["n_params"])
        out[rt] = figures
    return out


def wait_quiet(limit: float, max_wait: float) -> float:
    """Wait (up to `max_wait` s) until other processes use at most `limit` cores over a 1 s window; return it."""
    deadline = time.perf_counter() + max_wait
    while True:
        load = OutsideLoad()
        load.start()
        time.sleep(1.0)
        cores = load.stop()
        if cores <= limit or time.perf_counter() > deadline:
            return cores
        time.sleep(2.0)


def measure(args: argparse.Namespace, rt: str, prompt_len: int) -> dict[str, Any]:
    """A run whose outside load stayed under the limit (retried up to --retries times; else the quietest)."""
    tries = []
    for attempt in range(args.retries + 1):
        wait_quiet(args.max_outside, args.quiet_wait)
        r = run_worker(args, rt, prompt_len)
        if "error" in r:
            return r
        r["attempts"] = attempt + 1
        tries.append(r)
        if r["outside_cores"] <= args.max_outside:
            break
        print(f"    {rt} p{prompt_len}: {r['outside_cores']:.2f} cores of outside load, retrying",
              file=sys.stderr, flush=True)
        time.sleep(args.retry_wait)
    best = min(tries, key=lambda r: r["outside_cores"])
    best["noisy"] = best["outside_cores"] > args.max_outside
    return best


def agreement(tokens: list[int], ref: list[int]) -> tuple[int, int]:
    """(leading tokens equal, length)."""
    n = 0
    for a, b in zip(tokens, ref):
        if a != b:
            break
        n += 1
    return n, min(len(tokens), len(ref))


def _med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(args: argparse.Namespace, runtimes: list[str], results: dict) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for n in args.prompts:
        rows = {}
        for rt in runtimes:
            runs = [r for r in results[(rt, n)] if "error" not in r]
            if not runs:
                rows[rt] = {"error": next((r["error"] for r in results[(rt, n)]), "no runs")}
                continue
            token_sets = {tuple(r["tokens"]) for r in runs}
            rows[rt] = {"prefill_tok_s": _med(runs, "prefill_tok_s"), "decode_tok_s": _med(runs, "decode_tok_s"),
                        "peak_rss_mib": max(r["peak_rss"] for r in runs) / MiB,
                        "libs_rss_mib": max(r.get("rss_libs", 0) for r in runs) / MiB,
                        "outside_cores_max": max(r["outside_cores"] for r in runs),
                        "noisy_runs": sum(bool(r.get("noisy")) for r in runs), "runs": len(runs),
                        "deterministic": len(token_sets) == 1, "tokens": runs[0]["tokens"],
                        "prefill_all": [r["prefill_tok_s"] for r in runs],
                        "decode_all": [r["decode_tok_s"] for r in runs]}
        ref_rt = "llama-f32" if "tokens" in rows.get("llama-f32", {}) else next(
            (rt for rt in runtimes if "tokens" in rows[rt]), None)
        for rt, row in rows.items():
            if "tokens" not in row:
                continue
            if ref_rt:
                row["agree"] = agreement(row["tokens"], rows[ref_rt]["tokens"])
                row["agree_ref"] = ref_rt
            base = BASELINE.get(RUNTIMES[rt][1])
            if base in rows and "tokens" in rows[base] and base != rt:
                b = rows[base]
                row["vs"] = base
                for k in ("prefill_tok_s", "decode_tok_s"):
                    row[k.replace("_tok_s", "_x")] = (row[k] / b[k]) if row[k] and b[k] else None
                row["rss_x"] = row["peak_rss_mib"] / b["peak_rss_mib"]
            ort = ORT_OF.get(rt)
            if ort in rows and "tokens" in rows[ort]:  # against ONNX Runtime on the same weights, this run
                o = rows[ort]
                row["vs_ort"] = ort
                for k in ("prefill_tok_s", "decode_tok_s"):
                    row[k.replace("_tok_s", "_x_ort")] = (row[k] / o[k]) if row[k] and o[k] else None
                row["rss_x_ort"] = row["peak_rss_mib"] / o["peak_rss_mib"]
                row["agree_ort"] = agreement(row["tokens"], o["tokens"])
        summary[n] = rows
    return summary


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _span(vals: list, fmt: str) -> str:
    vals = [v for v in vals if v is not None]
    return f"{format(min(vals), fmt)}-{format(max(vals), fmt)}" if vals else "-"


def host_info(threads: int) -> dict[str, Any]:
    """The CPU model and the pace of one thread, and of `threads` threads together, reading 512 MiB (numpy sums,
    best of 3): ratios taken on hosts whose memory differs (~19 against ~42 GB/s between two hosts of this project)
    do not compare."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    model = "unknown CPU"
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    a = np.ones(64 << 20)  # 512 MiB of float64
    best = min(_timed(a.sum) for _ in range(3))
    parts = np.array_split(a, threads)  # numpy's sum releases the GIL: the threads read at once
    with ThreadPoolExecutor(threads) as pool:
        together = min(_timed(lambda: list(pool.map(np.sum, parts))) for _ in range(3))
    return {"cpu": model, "cpus": os.cpu_count(), "read_gb_s": a.nbytes / best / 1e9,
            "read_gb_s_threads": a.nbytes / together / 1e9}


def step_bytes(art: dict[str, Any]) -> dict[str, int] | None:
    """Bytes of weights one decode step reads, by weights family: every parameter the token uses (`k3export.info`'s
    active count: the routed experts top-k of E), the embedding table but its one row; fp32, and with the routed
    experts at MXFP4's 4.25 bits. None without the PyTorch folder's config."""
    folder = art["paths"].get("torch")
    if not folder or not (Path(folder) / "config.json").is_file():
        return None
    from k3export.info import count_parameters
    from k3export.modeling import K3Config

    config = K3Config.from_pretrained(folder)
    counts = count_parameters(config)
    dense = counts.active - counts.by_kind["embedding"] + config.hidden_size
    experts = counts.by_kind["moe_routed"] * config.num_experts_per_token // config.num_experts
    return {"f32": 4 * dense, "mxfp4": 4 * (dense - experts) + experts * 17 // 32}


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def print_quality(args: argparse.Namespace, runtimes: list[str], quality: dict[str, dict[str, Any]]) -> None:
    first = next((q for q in quality.values() if "tokens" in q), None)
    if first is None:
        return
    print(f"\nquality against PyTorch fp32 over {first['tokens']} scored tokens ({args.quality_windows} windows of "
          f"{args.quality_context} tokens of the repository docs, second halves; random weights make flat "
          "distributions, so read the figures as distance from the fp32 model); bits/weight: weight files x 8 / "
          "parameters")
    print("| runtime | bits/weight | PPL | ln(PPL/ref) | mean KLD +- err | KLD p99 | KLD max | top-1 | RMS dp |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rt in runtimes:
        q = quality.get(rt, {})
        if "error" in q:
            print(f"| {rt} | failed: ...{q['error'][-90:]} | | | | | | | |")
        elif q:
            print(f"| {rt} | {q['bits_per_weight']:.2f} | {q['ppl']:.2f} | {q['ln_ppl_ratio']:.2e} | "
                  f"{q['kld_mean']:.2e} +- {q['kld_stderr']:.1e} | {q['kld_p99']:.2e} | {q['kld_max']:.2e} | "
                  f"{q['top1_agree']:.4f} | {q['delta_p_rms']:.2e} |")


def print_report(args: argparse.Namespace, art: dict, runtimes: list[str], summary: dict, host: dict,
                 quality: dict[str, dict[str, Any]]) -> None:
    print(f"\nhost: {host['cpu']}, {host['cpus']} CPUs, one thread reads {host['read_gb_s']:.1f} GB/s, "
          f"{args.threads} threads together {host['read_gb_s_threads']:.1f} GB/s")
    weights = step_bytes(art) or {}
    floor = {family: host["read_gb_s_threads"] * 1e9 / n for family, n in weights.items()}
    for family, tok_s in floor.items():
        print(f"decode floor, {family} weights: a step reads {weights[family] / 1e6:.1f} MB of them, so at most "
              f"{tok_s:.0f} tok/s at the {args.threads} threads' read pace (column 'x floor')")
    print(f"K3 {art['n_params'] / 1e6:.1f}M parameters ({art['source']}), fp32, {args.threads} threads, "
          f"{args.steps} greedy steps, median of {args.reps} interleaved run(s) per cell; peak RSS is the max.")
    for n, rows in summary.items():
        print(f"\nprompt {n} tokens + {args.steps} greedy steps")
        print("| runtime | prefill tok/s | decode tok/s | decode x floor | peak RSS MiB | of it libraries | prefill x "
              "| decode x | RSS x | vs | greedy tokens = ref | prefill, decode min-max |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
        for rt in runtimes:
            row = rows[rt]
            if "error" in row:
                print(f"| {rt} | failed: ...{row['error'][-90:]} | | | | | | | | | | |")
                continue
            ag = row.get("agree")
            agree = (f"{ag[0]}/{ag[1]}" + ("" if ag[0] == ag[1] else f" (diverges at {ag[0]})")
                     if ag and row.get("agree_ref") != rt else "ref")
            flags = "" if row["deterministic"] else " (tokens vary between runs)"
            noisy = f" [{row['noisy_runs']} noisy]" if row["noisy_runs"] else ""
            of_floor = (row["decode_tok_s"] / floor[RUNTIMES[rt][1]]
                        if row.get("decode_tok_s") and RUNTIMES[rt][1] in floor else None)
            print(f"| {rt}{noisy} | {_f(row['prefill_tok_s'], '.0f')} | {_f(row['decode_tok_s'], '.1f')} "
                  f"| {_f(of_floor, '.2f')} | {row['peak_rss_mib']:.0f} | {row['libs_rss_mib']:.0f} | {_f(row.get('prefill_x'), '.2f')} | {_f(row.get('decode_x'), '.2f')} "
                  f"| {_f(row.get('rss_x'), '.2f')} | {row.get('vs', '-')} | {agree}{flags} "
                  f"| {_span(row['prefill_all'], '.0f')}, {_span(row['decode_all'], '.1f')} |")
    for n, rows in summary.items():
        have = [rt for rt in runtimes if "tokens" in rows.get(rt, {})]
        pairs = [f"{a} = {b}: {agreement(rows[a]['tokens'], rows[b]['tokens'])[0]}/{len(rows[a]['tokens'])}"
                 for i, a in enumerate(have) for b in have[i + 1:]]
        if len(pairs) > 1:
            print(f"\nleading greedy tokens equal, prompt {n}: " + "; ".join(pairs))
    for n, rows in summary.items():
        for rt, row in rows.items():
            if "vs_ort" in row:
                ag = row["agree_ort"]
                print(f"\n{rt} against {row['vs_ort']} (prompt {n}, same weights, this run): prefill "
                      f"{_f(row['prefill_x_ort'], '.2f')}x, decode {_f(row['decode_x_ort'], '.2f')}x, peak RSS "
                      f"{row['rss_x_ort']:.2f}x; greedy tokens equal {ag[0]}/{ag[1]}")
    if any("llama-mxfp4" in rows for rows in summary.values()):
        print("\nllama-mxfp4 tokens are not expected to match: ggml-cpu quantises the expert inputs to Q8_0 for the"
              " MXFP4 dot products, which flips near-tie expert choices (PEERS.md). Its weights are the same.")
    for rt, why in art.get("notes", {}).items():
        if rt in RUNTIMES:
            print(f"\n{rt}: not run: {why}")
    print_quality(args, runtimes, quality)
    checks = []

    def check(label: str, ok: bool, *rows: dict) -> None:
        noisy = any(r.get("noisy_runs") for r in rows)
        checks.append(f"  {'NOISY' if noisy else 'PASS ' if ok else 'FAIL '} {label}")

    def ratio(tag: str, rt: str, key: str, n: int, rows: dict, ok: Any) -> None:
        row = rows.get(rt, {})
        if row.get(key) is not None:
            check(f"[{tag}] {rt} {key} vs {row['vs']} (prompt {n}): {row[key]:.2f}x", ok(row[key]), row,
                  rows[row["vs"]])

    for n, rows in summary.items():
        ratio("f32", "ort", "decode_x", n, rows, lambda x: x >= 1.0)
        ratio("f32", "ort", "prefill_x", n, rows, lambda x: x >= 1.0)
        ratio("f32", "ort", "rss_x", n, rows, lambda x: x <= 1.5)
        ratio("f32", "torch", "decode_x", n, rows, lambda x: x >= 0.5)
        ratio("mxfp4", "ort-mxfp4", "decode_x", n, rows, lambda x: x >= 1.0)
        # the CPU targets of the native libraries: ORT's runner >= 0.9x llama.cpp without them, >= 1.2x with its
        # library; OpenVINO with its extension >= 1.2x in decode and prefill at <= 1.0x the RSS; MXFP4 >= 1.0x
        ratio("f32", "ort-k3", "decode_x", n, rows, lambda x: x >= 0.9)
        for rt in ("ort-plain", *PLAIN_FORMS):  # plain ONNX Runtime: >= 0.9x in decode, >= 1.2x in prefill
            ratio("f32", rt, "decode_x", n, rows, lambda x: x >= 0.9)
            ratio("f32", rt, "prefill_x", n, rows, lambda x: x >= 1.2)
        ratio("f32", "ort-k3-ops", "decode_x", n, rows, lambda x: x >= 1.2)
        for key, ok in (("decode_x", lambda x: x >= 1.2), ("prefill_x", lambda x: x >= 1.2),
                        ("rss_x", lambda x: x <= 1.0)):
            for rt in ("openvino-k3-ext", "openvino-k3-ext-decode"):
                ratio("f32", rt, key, n, rows, ok)
        for rt in ("ort-mxfp4-ops", "openvino-mxfp4-ext"):
            ratio("mxfp4", rt, "decode_x", n, rows, lambda x: x >= 1.0)
        row = rows.get("ort-nvfp4-ops", {})
        if row.get("decode_x_ort") is not None:  # NVFP4 experts within 10% of the MXFP4 export's pace
            check(f"[nvfp4] ort-nvfp4-ops decode vs ort-mxfp4-ops (prompt {n}): {row['decode_x_ort']:.2f}x >= 0.9",
                  row["decode_x_ort"] >= 0.9, row, rows["ort-mxfp4-ops"])
        ratio("q8", "ort-int8-ops", "decode_x", n, rows, lambda x: x >= 1.2)
        ratio("q4", "ort-int4-ops", "decode_x", n, rows, lambda x: x >= 1.2)
        f32 = [rt for rt in ("ort", "openvino", "torch", "llama-f32") if "agree" in rows.get(rt, {})]
        if len(f32) > 1:
            same = all(rows[rt]["agree"][0] == rows[rt]["agree"][1] for rt in f32)
            check(f"[f32] greedy tokens identical on F32 weights (prompt {n}): {', '.join(f32)}", same)
        if "tokens" in rows.get("torch-f64", {}):
            ref64 = rows["torch-f64"]["tokens"]
            got = {rt: agreement(rows[rt]["tokens"], ref64) for rt in ("ort", "openvino", "torch", "llama-f32")
                   if "tokens" in rows.get(rt, {})}
            check(f"[f32] greedy tokens vs float64 (prompt {n}): "
                  + ", ".join(f"{rt} {a}/{b}" for rt, (a, b) in got.items()) + " (ours must equal it)",
                  all(a == b for rt, (a, b) in got.items() if rt != "llama-f32"))
    lens = sorted(summary)
    if len(lens) > 1 and all("peak_rss_mib" in summary[n].get("ort", {}) for n in lens):
        lo, hi = summary[lens[0]]["ort"], summary[lens[-1]]["ort"]
        grow = hi["peak_rss_mib"] / lo["peak_rss_mib"]
        check(f"[f32] ort peak RSS flat in prompt length: {lo['peak_rss_mib']:.0f} MiB at {lens[0]} -> "
              f"{hi['peak_rss_mib']:.0f} MiB at {lens[-1]} ({grow:.2f}x; 'flat' read as <= 1.1x)", grow <= 1.1,
              lo, hi)
    for rt, base in (("ort-int8-ops", "llama-q8_0"), ("ort-int4-ops", "llama-q4_0")):
        a, b = quality.get(rt, {}).get("kld_mean"), quality.get(base, {}).get("kld_mean")
        if a is not None and b is not None:
            check(f"[quality] {rt} mean KLD {a:.2e} <= {base}'s {b:.2e}", a <= b)
    for rt in ("ort", "ort-k3", "ort-k3-ops"):
        q = quality.get(rt, {})
        if "kld_mean" in q:
            check(f"[quality] {rt} (fp32): top-1 {q['top1_agree']:.4f} >= 0.999, mean KLD {q['kld_mean']:.1e} < 1e-6",
                  q["top1_agree"] >= 0.999 and q["kld_mean"] < 1e-6)
    if checks:
        print("\nTargets ([f32]: the fp32 export against llama.cpp's F32 GGUF, [mxfp4]: the MXFP4 export against its "
              "MXFP4 GGUF, [q8] / [q4]: the int8 / int4 export against llama.cpp's Q8_0 / Q4_0 GGUF, [quality]: "
              "against PyTorch fp32; a check reads NOISY where one of its runs stayed above --max-outside after "
              "every retry):")
        print("\n".join(checks))
    noisy = [f"{rt}@{n}" for n, rows in summary.items() for rt, row in rows.items() if row.get("noisy_runs")]
    if noisy:
        print(f"\nWARNING: other processes used more than {args.max_outside} cores during some runs "
              f"({', '.join(noisy)}); those numbers measure contention, not the runtime. Rerun on a quiet machine.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help="comma-separated, from: " + ", ".join(RUNTIMES))
    ap.add_argument("--prompts", default=None, help="prompt lengths, comma-separated (default 64,512)")
    ap.add_argument("--steps", type=int, default=None, help="greedy decode steps (default 256)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm-steps", type=int, default=None, help="decode steps in the warm-up (default 8)")
    ap.add_argument("--quick", action="store_true", help="smoke run: prompt 64, 16 steps, 1 repetition")
    ap.add_argument("--config", default=str(BIG_CFG), help="config overrides over K3Config.tiny() (JSON)")
    ap.add_argument("--source", default=None, help="a released-layout K3 folder to use instead of random weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-dir", default=None, help="llama.cpp sdist + build ($K3EXPORT_LLAMA_DIR, else ../llama)")
    ap.add_argument("--work-dir", default=None, help="artifacts (default <llama dir>/peers)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the weights and GGUFs of a previous run (the ONNX export is always redone)")
    ap.add_argument("--jobs", type=int, default=2, help="build jobs for llama.cpp")
    ap.add_argument("--max-outside", type=float, default=0.1, help="retry a run above this many outside cores")
    ap.add_argument("--retries", type=int, default=4)
    ap.add_argument("--retry-wait", type=float, default=5.0)
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each run, wait up to this many seconds for the machine to be quiet")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    ap.add_argument("--json", default=None, help="write every run and the summary here")
    ap.add_argument("--quality-windows", type=int, default=None,
                    help="windows of the docs token stream scored for quality (default 8, --quick 4; 0: none)")
    ap.add_argument("--quality-context", type=int, default=128, help="tokens a quality window (second half scored)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quality-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    q = args.quick
    args.steps = args.steps if args.steps is not None else (16 if q else 256)
    args.reps = args.reps if args.reps is not None else (1 if q else 3)
    args.warm_steps = args.warm_steps if args.warm_steps is not None else (2 if q else 8)
    args.quality_windows = args.quality_windows if args.quality_windows is not None else (4 if q else 8)
    args.prompts = [int(x) for x in (args.prompts or ("64" if q else "64,512")).split(",")]
    args.llama_dir = str(Path(args.llama_dir).absolute() if args.llama_dir else llamacpp.default_root())
    args.work_dir = str(Path(args.work_dir).absolute() if args.work_dir else Path(args.llama_dir) / "peers")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        (quality_worker if args.quality_worker else worker)(args)
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    bad = [r for r in runtimes if r not in RUNTIMES]
    if bad:
        raise SystemExit(f"unknown runtime(s) {bad}; choose from {list(RUNTIMES)}")
    if any(r.startswith("llama") for r in runtimes):
        t = time.perf_counter()
        llamacpp.ensure(Path(args.llama_dir), args.jobs)
        _step(f"llama.cpp {llamacpp.VERSION} ready in {args.llama_dir}", t)
    art = build_artifacts(args, runtimes)
    for rt in runtimes:
        if rt not in art["paths"]:
            print(f"  {rt}: not run ({art['notes'].get(rt) or art['notes'].get(READS.get(rt, rt)) or 'no input'})",
                  file=sys.stderr)
    runtimes = [r for r in runtimes if r in art["paths"]]
    import random

    rng = random.Random(args.seed + 1)
    prompts = {str(n): [rng.randrange(3, art["vocab_size"]) for _ in range(n)] for n in args.prompts}
    (Path(args.work_dir) / "prompts.json").write_text(json.dumps(prompts) + "\n")

    host = host_info(args.threads)
    results: dict[tuple[str, int], list[dict]] = {(rt, n): [] for rt in runtimes for n in args.prompts}
    for n in args.prompts:
        for rep in range(args.reps):
            for rt in runtimes if rep % 2 == 0 else runtimes[::-1]:  # A, B, C, C, B, A, ...: drift cancels
                if rt == "torch-f64" and rep:  # a token reference: one run
                    continue
                r = measure(args, rt, n)
                if "error" not in r:
                    print(f"  p{n} rep {rep + 1}/{args.reps} {rt:12s} prefill {r['prefill_tok_s']:7.1f} tok/s  "
                          f"decode {_f(r['decode_tok_s'], '6.1f')} tok/s  RSS {r['peak_rss'] / MiB:6.0f} MiB  "
                          f"outside {r['outside_cores']:.2f} cores (try {r['attempts']})", file=sys.stderr,
                          flush=True)
                else:
                    print(f"  p{n} rep {rep + 1}/{args.reps} {rt:12s} FAILED: {r['error']}", file=sys.stderr,
                          flush=True)
                results[(rt, n)].append(r)
    summary = summarise(args, runtimes, results)
    quality = quality_pass(args, art, runtimes) if args.quality_windows else {}
    print_report(args, art, runtimes, summary, host, quality)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items()}, "host": host, "artifacts": art,
            "runs": {f"{rt}@{n}": v for (rt, n), v in results.items()}, "quality": quality,
            "summary": {str(n): rows for n, rows in summary.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
