"""llama.cpp as a peer for the benchmarks: fetch, build, write its input, convert, and run it.

Nothing here is a k3export dependency. llama.cpp is the copy vendored in the PyPI sdist of
``llama-cpp-python`` (``../shared/spec/PEERS.md``): it is downloaded with pip, unpacked and built with cmake
into a folder outside the repository (default ``../llama`` next to the repo, or ``$K3EXPORT_LLAMA_DIR``). The
Python side uses the sdist's own ctypes wrappers of the C API (``llama_cpp/llama_cpp.py``, generated for the
same ``llama.h``) straight from the unpacked sdist, so nothing is installed into the environment.

    root/
      llama_cpp_python-<version>/            unpacked sdist (vendor/llama.cpp: sources and converter)
      build/bin/libllama.so                  the build (+ libggml*.so)
      build.log                              cmake output

Also here: the released-layout K3 folder that llama.cpp's converter reads, written from a model's weights
(dense tensors in float32, routed experts either dequantised or as compressed-tensors MXFP4), and a small
MXFP4 codec used to put a model's experts on the MXFP4 grid so every runtime runs the same weights.

    python bench/llamacpp.py [--llama-dir DIR] [--jobs 2]   # fetch and build llama.cpp now (bench/peers.py does it
                                                           # on first use)
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

VERSION = "0.3.36"
REPO_ROOT = Path(__file__).resolve().parent.parent
GROUP = 32  # MXFP4 block size
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_TOOLS=OFF")


# ----------------------------------------------------------------------------------------------- where things are
def default_root() -> Path:
    return Path(os.environ.get("K3EXPORT_LLAMA_DIR") or REPO_ROOT.parent / "llama").absolute()


def sdist_dir(root: Path, version: str = VERSION) -> Path:
    return root / f"llama_cpp_python-{version}"


def source_dir(root: Path, version: str = VERSION) -> Path:
    return sdist_dir(root, version) / "vendor" / "llama.cpp"


def lib_dir(root: Path) -> Path:
    return root / "build" / "bin"


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- fetch and build
def fetch(root: Path, version: str = VERSION) -> Path:
    """Download the llama-cpp-python sdist with pip and unpack it; return vendor/llama.cpp."""
    src = source_dir(root, version)
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    tarball = root / f"llama_cpp_python-{version}.tar.gz"
    if not tarball.is_file():
        _log(f"pip download llama-cpp-python=={version} (sdist) into {root}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(root)], check=True)
    _log(f"unpacking {tarball.name}")
    with tarfile.open(tarball) as tf:
        tf.extractall(root, filter="data")
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{tarball} did not unpack to {src}")
    return src


def build(root: Path, jobs: int = 2, version: str = VERSION) -> Path:
    """cmake-build libllama (CPU, native) as PEERS.md says; return the folder holding libllama.so."""
    out = lib_dir(root)
    if (out / "libllama.so").is_file():
        return out
    src = fetch(root, version)
    log = root / "build.log"
    _log(f"building llama.cpp into {root / 'build'} with {jobs} jobs (minutes; log: {log})")
    with open(log, "w") as f:
        subprocess.run(["cmake", "-S", str(src), "-B", str(root / "build"), *CMAKE_FLAGS],
                       stdout=f, stderr=subprocess.STDOUT, check=True)
        subprocess.run(["cmake", "--build", str(root / "build"), "--target", "llama", f"-j{jobs}"],
                       stdout=f, stderr=subprocess.STDOUT, check=True)
    if not (out / "libllama.so").is_file():
        raise RuntimeError(f"the build finished without {out / 'libllama.so'}; see {log}")
    return out


def ensure(root: Path | None = None, jobs: int = 2) -> Path:
    """Fetch and build if needed; return the root."""
    root = root or default_root()
    build(root, jobs)
    return root


# ------------------------------------------------------------------------------------------------------ MXFP4 codec
def mxfp4_pack(w: Any) -> tuple[Any, Any]:
    """float [out, in] -> (packed uint8 [out, in/2], E8M0 scale uint8 [out, in/32]), compressed-tensors' layout
    (element 2j in the low nibble of byte j). Scale 2^(floor(log2(amax)) - 2), values rounded to nearest E2M1."""
    import torch

    w = w.detach().float()
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -120)
    exp = torch.floor(torch.log2(amax)) - 2  # E2M1's largest exponent is 2 (6 = 1.5 * 2^2)
    scale = (exp + 127).clamp(1, 254)
    x = g / torch.pow(2.0, scale - 127).unsqueeze(-1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # between neighbouring E2M1 magnitudes
    idx = torch.bucketize(x.abs(), mids)  # nearest magnitude (ties: the smaller one)
    nib = (idx | ((x < 0) & (idx > 0)).to(idx.dtype) << 3).to(torch.uint8).reshape(out_f, in_f)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    return packed, scale.to(torch.uint8).contiguous()


def mxfp4_decode(packed: Any, scale: Any) -> Any:
    """(packed, scale) -> float32 [out, in]; exact."""
    import torch

    table = torch.tensor(E2M1)
    out_f = packed.shape[0]
    nib = torch.stack([packed & 0xF, packed >> 4], -1).reshape(out_f, -1).long()
    vals = table[nib].reshape(out_f, -1, GROUP)
    return (vals * torch.pow(2.0, scale.float() - 127).unsqueeze(-1)).reshape(out_f, -1)


def is_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name and name.endswith((".w1.weight", ".w2.weight", ".w3.weight"))


def snap_experts_to_mxfp4(model: Any) -> dict[str, tuple[Any, Any]]:
    """Round every routed-expert weight of `model` to the MXFP4 grid in place; return {name: (packed, scale)}.

    Afterwards the fp32 model, its dequantised export and an MXFP4 checkpoint hold exactly the same weights."""
    import torch

    packs: dict[str, tuple[Any, Any]] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_expert(name):
                packed, scale = mxfp4_pack(p)
                p.copy_(mxfp4_decode(packed, scale).to(p.dtype))
                packs[name] = (packed, scale)
    return packs


# --------------------------------------------------------------------------------- released-layout input folders
def _text_config(config: Any) -> dict[str, Any]:
    """The released ``text_config``: from k3export's synthetic writer when it has one, else every config field."""
    try:
        from k3export.converters.checkpoints.synthetic import text_config_dict

        return text_config_dict(config)
    except ImportError:  # pragma: no cover - the synthetic writer moved
        d = {k: v for k, v in config.to_dict().items()
             if k not in ("architectures", "auto_map", "transformers_version", "torch_dtype", "dtype")}
        d["model_type"] = "kimi_linear"
        return d


def _quantization_config() -> dict[str, Any]:
    try:
        from k3export.converters.checkpoints.synthetic import QUANTIZATION_CONFIG

        return json.loads(json.dumps(QUANTIZATION_CONFIG))
    except ImportError:  # pragma: no cover
        return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                              "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                          "group_size": GROUP, "symmetric": True}}}}


def write_released(model: Any, out_dir: Path, packs: dict[str, tuple[Any, Any]] | None = None,
                   shard_bytes: int = 1 << 30) -> Path:
    """Write `model`'s weights as a released-layout K3 folder (``language_model.`` prefix, nested text_config).

    Dense tensors are float32. Routed experts are dequantised float32 ``.weight`` tensors, or, with `packs`
    (from `snap_experts_to_mxfp4`), compressed-tensors ``weight_packed`` + ``weight_scale`` with a
    ``quantization_config`` saying so."""
    import torch
    from safetensors.torch import save_file

    from k3export.files import INDEX_NAME

    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, t in model.state_dict().items():
        stored = "language_model." + name
        if packs is not None and name in packs:
            base = stored.removesuffix(".weight")
            tensors += [(base + ".weight_packed", packs[name][0]), (base + ".weight_scale", packs[name][1])]
        else:
            tensors.append((stored, t.detach().float().contiguous()))
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: t for n, t in shard}, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n, _ in shard})
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    (out_dir / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    text = _text_config(config)
    # the released config has it (MLA: one KV head per attention head) and llama.cpp's converter reads it to
    # split kv_b_proj; K3Config drops it as meaningless for NoPE MLA
    text.setdefault("num_key_value_heads", config.num_attention_heads)
    text.setdefault("max_position_embeddings", 1 << 20)  # llama.cpp needs a context length (released: 1M)
    cfg: dict[str, Any] = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "torch_dtype": "float32",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    if packs is not None:
        cfg["quantization_config"] = _quantization_config()
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


# ------------------------------------------------------------------------------------------------------- convert
_CONVERT = textwrap.dedent("""
    import sys
    from pathlib import Path
    src, model_dir, outfile, outtype = sys.argv[1:5]
    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import logging, torch
    import gguf
    from conversion.kimi_k3 import KimiK3Model

    class NoVocabKimiK3(KimiK3Model):
        model_arch = KimiK3Model.model_arch  # base.py wants it in every subclass's own __dict__

        # a folder without a tokenizer: the loader adds vocab_size dummy tokens (PEERS.md)
        def set_vocab(self):
            self._set_vocab_none()

    logging.basicConfig(level=logging.WARNING)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]
    with torch.inference_mode():
        m = NoVocabKimiK3(Path(model_dir), ftype, Path(outfile), eager=False)
        m.write()
    print(m.fname_out)
""")


def convert(root: Path, model_dir: Path, outfile: Path, outtype: str = "f32") -> Path:
    """llama.cpp's own HF->GGUF converter (its ``KimiK3Model``, tokenizer-less) on a released-layout folder."""
    src = fetch(root)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    tmp = outfile.with_name(outfile.name + ".partial")
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(model_dir), str(tmp), outtype],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp convert of {model_dir} failed:\n{r.stderr[-4000:]}")
    tmp.replace(outfile)
    return outfile


# -------------------------------------------------------------------------------------------------------- running
#: llama.cpp file types `quantize` makes (its `llama_ftype`): every matrix at that type, or (``MXFP4_MOE``) the routed
#: experts in MXFP4 and every other matrix in Q8_0, which is how llama.cpp ships MXFP4-expert models quantized
QUANT_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
               "mxfp4_moe": "LLAMA_FTYPE_MOSTLY_MXFP4_MOE"}


def quantize(root: Path, src: Path, out: Path, kind: str, threads: int = 2) -> Path:
    """`src` (an F32 GGUF) quantized to `kind` (`QUANT_TYPES`) by llama.cpp's own `llama_model_quantize`, what its
    `llama-quantize` tool runs; written beside, then moved onto `out`."""
    L = bindings(root)
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, QUANT_TYPES[kind])
    params.nthread = threads
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    rc = L.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {kind}) returned {rc}")
    part.replace(out)
    return out


def bindings(root: Path) -> types.ModuleType:
    """The sdist's ctypes wrappers of llama.h, loaded against our build, without the package's high-level API."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir(root))
    if "llama_cpp.llama_cpp" in sys.modules:
        return sys.modules["llama_cpp.llama_cpp"]
    pkg = types.ModuleType("llama_cpp")  # a bare package: skips llama_cpp/__init__ (chat formats, jinja, ...)
    pkg.__path__ = [str(sdist_dir(root) / "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    import importlib

    return importlib.import_module("llama_cpp.llama_cpp")


class LlamaCppRunner:
    """One model and one context; greedy steps on token ids (no tokenizer): `prefill`, `step`, `reset`."""

    def __init__(self, root: Path, gguf_path: Path, threads: int, n_ctx: int, n_batch: int,
                 quiet: bool = True, f32_cache: bool = True) -> None:
        L = self.L = bindings(root)
        if quiet:
            self._log_cb = L.llama_log_callback(lambda level, text, user: None)
            L.llama_log_set(self._log_cb, ctypes.c_void_p())
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        if f32_cache:  # the default KV cache is F16; the comparison is fp32 (k3export's caches are fp32)
            cp.type_k = cp.type_v = L.GGML_TYPE_F32
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.pos = 0

    def reset(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        self.pos = 0

    def _decode(self, tokens: Iterable[int], every: bool = False) -> Any:
        """Run `tokens` on from the current position: the logits of the last one, or of each (`every`), float32
        [n, vocab] copied out of llama.cpp's buffer."""
        import numpy as np

        tokens = list(tokens)
        n = len(tokens)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens in one call; the context was made for batches of {self.n_batch}")
        b = self.batch
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = self.pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = every or i == n - 1
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.pos += n
        rows = range(n) if every else [-1]
        return np.stack([np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                         for i in rows]).copy()

    def logits(self, tokens: Iterable[int]) -> Any:
        """float32 [n, vocab]: the next-token logits at every position of `tokens`, from an empty context."""
        self.reset()
        return self._decode(tokens, every=True)

    def prefill(self, tokens: Iterable[int]) -> int:
        return int(self._decode(tokens)[0].argmax())

    def step(self, token: int) -> int:
        return int(self._decode([token])[0].argmax())

    def close(self) -> None:
        L = self.L
        if self.batch is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Fetch and build llama.cpp for the benchmarks (bench/peers.py does it "
                                             "on first use).")
    ap.add_argument("--llama-dir", type=Path, default=None, help="sdist + build ($K3EXPORT_LLAMA_DIR, else ../llama)")
    ap.add_argument("--jobs", type=int, default=2, help="build jobs")
    args = ap.parse_args(argv)
    root = ensure(args.llama_dir.absolute() if args.llama_dir else None, args.jobs)
    print(lib_dir(root) / "libllama.so")


__all__ = ["LlamaCppRunner", "QUANT_TYPES", "VERSION", "bindings", "build", "convert", "default_root", "ensure", "fetch",
           "lib_dir", "mxfp4_decode", "mxfp4_pack", "quantize", "snap_experts_to_mxfp4", "source_dir", "write_released"]


if __name__ == "__main__":
    main()
