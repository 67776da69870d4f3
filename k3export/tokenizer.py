# Copyright 2026 the k3export authors. Apache-2.0.
"""The tokenizer travels with every artifact: copied on convert, written for transformers and onnxruntime-genai on
export, and loaded here for ``k3export generate``.

Released K3 and Kimi-Linear folders ship a tiktoken BPE (``tiktoken.model``: one ``base64(token) rank`` line per
token), a ``tokenizer_config.json`` (special tokens in ``added_tokens_decoder``, their ids right after the BPE
ranks; ``bos_token`` / ``eos_token`` / ``pad_token`` by name), a chat template (in the config or
``chat_template.jinja``) and the remote-code ``tokenization_kimi.py`` that splits text with `KIMI_PATTERN`.

    copy_tokenizer_files(src, dst)                   # convert: the source's tokenizer files, unchanged
    write_export_tokenizer(src, export_dir, config)  # export: tokenizer.json (+ config, chat template) and
                                                     #         genai_tokenizer/ when genai cannot read that one
    tok = load_tokenizer(folder)                     # transformers tokenizer of a checkpoint or an export
    write_tiny_tokenizer(folder, config)             # `k3export tiny`: a small byte-level BPE made on the spot

``tokenizer.json`` is transformers' conversion of the tiktoken BPE (``TikTokenConverter``) with the special tokens at
their released ids: it encodes exactly as tiktoken does. onnxruntime-genai 0.18 (onnxruntime-extensions) cannot
compile `KIMI_PATTERN` (``&&`` class intersections and ``\\p{Han}`` are outside its pre-tokenizer; it fails with
"Invalid regex"), so the export also writes ``genai_tokenizer/`` (named by ``model.tokenizer_dir`` in
``genai_config.json``) whose pre-tokenizer is the closest one genai can run: first a split on genai's CJK run
(U+4E00-U+9FA5 and kana), then o200k-style letters without the Han exclusion (`GENAI_KIMI_SEQUENCE`). It encodes
like ``tokenizer.json`` except where the Han boundaries differ (`GENAI_DIFFERENCES`); decoding is identical.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3export.errors import K3ExportError

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENAI_TOKENIZER_DIR = "genai_tokenizer"
#: files `copy_tokenizer_files` carries from a source folder (whichever exist); ``tokenization_*.py`` too
TOKENIZER_FILES = (TIKTOKEN_FILE, TOKENIZER_JSON, TOKENIZER_CONFIG, "special_tokens_map.json", CHAT_TEMPLATE_FILE,
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
#: Kimi's reserved special-token slots after the BPE ranks (``tokenization_kimi.py``)
NUM_RESERVED_SPECIAL_TOKENS = 256
#: the largest tokenizer file read (read whole, then parsed: a bigger one is a memory bomb); the largest real
#: tokenizer.json files (256k-token vocabularies) hold ~35 MB
MAX_TOKENIZER_BYTES = 128 << 20

#: the pre-tokenizer of ``tokenization_kimi.py`` (K3, Kimi-Linear, Kimi-K2)
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
#: `KIMI_PATTERN` as onnxruntime-genai 0.18 can run it: every piece is one of onnxruntime-extensions' built-in
#: matchers (an unknown piece would go to std::regex, which has no \p{...})
GENAI_KIMI_SEQUENCE = (
    "[一-龥぀-ゟ゠-ヿ]+",
    "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
    ]),
)
#: where ``genai_tokenizer/`` splits text differently from `KIMI_PATTERN` (ids differ only where the vocabulary
#: has a token across the differing boundary)
GENAI_DIFFERENCES = (
    "Han characters outside U+4E00-U+9FA5 (extension blocks, compatibility ideographs, radicals, U+3005, U+3007) "
    "are split like other letters instead of as a Han run",
    "kana (U+3040-U+30FF) is split off as a run of its own instead of joining adjacent non-Han letters or one "
    "leading punctuation / space character",
    "two or more spaces before a Han run stay one piece instead of splitting off the last space",
)


class TokenizerError(K3ExportError):
    """A tokenizer folder that cannot be read or converted; the message names the file and field."""


# ---------------------------------------------------------------------------------------------- reading a source
@dataclass
class TokenizerSource:
    """The tokenizer of a folder: a tiktoken BPE or an HF ``tokenizer.json``, its special tokens and template."""

    root: Path
    config: dict[str, Any]  # tokenizer_config.json ({} when absent)
    ranks: dict[bytes, int] | None = None  # tiktoken BPE
    tokenizer_json: Path | None = None  # an HF fast tokenizer
    specials: dict[str, int] = field(default_factory=dict)  # name -> id, in id order
    chat_template: str | None = None

    def token(self, key: str) -> str | None:
        """``bos_token`` / ``eos_token`` / ... of the config as a string (AddedToken dicts give their content)."""
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v if isinstance(v, str) else None


def has_tokenizer(folder: str | os.PathLike[str]) -> bool:
    p = Path(folder)
    return (p / TIKTOKEN_FILE).is_file() or (p / TOKENIZER_JSON).is_file()


def _read_text(path: Path) -> str:
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise TokenizerError(f"{path}: larger than {MAX_TOKENIZER_BYTES} bytes")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _read_json(path: Path) -> dict[str, Any]:
    return _parse_json(_read_text(path), path)


def _parse_json(text: str, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def read_tiktoken_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """``base64(token) rank`` lines -> {token bytes: rank}; ranks must be 0..n-1, each token once."""
    p = Path(path)
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(_read_text(p).splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except ValueError:
            raise TokenizerError(f"{p}: line {n} is not 'base64-token rank'") from None
        if token in ranks:
            raise TokenizerError(f"{p}: line {n}: token {parts[0]} appears twice")
        ranks[token] = rank
    if not ranks:  # an empty BPE would write an empty tokenizer that encodes nothing
        raise TokenizerError(f"{p}: no tokens (expected one 'base64-token rank' line per token)")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{p}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def check_chat_template(template: str, where: str | os.PathLike[str]) -> None:
    """Compile `template` as transformers does (its sandboxed jinja2 environment and extensions); a syntax error
    is a `TokenizerError` naming `where` and the line, and so is a template that reads other templates or files
    (``include``, ``import``, ``extends``): a chat template renders the messages it is given, nothing else."""
    try:
        import jinja2
    except ImportError:
        raise TokenizerError(f"{where}: reading a chat template needs jinja2 (pip install jinja2)") from None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # private in transformers: jinja2's sandbox then, without transformers' own tags
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        compile_template = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string
    try:
        tree = compile_template(template).environment.parse(template)  # that environment's tags and extensions
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"{where}: chat template line {exc.lineno}: {exc.message}") from None
    from jinja2 import nodes

    for node in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
        keyword = {nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from ... import",
                   nodes.Extends: "extends"}[type(node)]
        raise TokenizerError(f"{where}: chat template line {node.lineno}: '{keyword}' reads another template or "
                             "file; a chat template may only render the messages it is given")


def check_token_ids(tok_json: dict[str, Any], vocab_size: int | None, where: str | os.PathLike[str]) -> None:
    """Every id of a tokenizer.json dict (vocabulary and added tokens) must be a row of the model's logits:
    export and generate both apply this rule."""
    if vocab_size is None:
        return
    model = tok_json.get("model") if isinstance(tok_json.get("model"), dict) else {}
    vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
    added = [t.get("id") for t in tok_json.get("added_tokens") or [] if isinstance(t, dict)]
    ids = [i for i in [*vocab.values(), *added] if isinstance(i, int)]
    top = max(ids, default=-1)
    if top >= vocab_size:
        raise TokenizerError(f"{where}: the tokenizer has token id {top}, outside the model's vocab_size "
                             f"{vocab_size}")


def read_tokenizer_source(folder: str | os.PathLike[str], vocab_size: int | None = None) -> TokenizerSource:
    """The tokenizer of `folder` (``tiktoken.model`` or ``tokenizer.json``, plus ``tokenizer_config.json`` and the
    chat template). For a tiktoken BPE the special tokens take the ids after the ranks, up to `vocab_size` (the
    model's) or the 256 reserved slots: named by ``added_tokens_decoder``, else ``<|reserved_token_{id}|>``."""
    root = Path(folder)
    cfg_path = root / TOKENIZER_CONFIG
    config = _read_json(cfg_path) if cfg_path.is_file() else {}
    src = TokenizerSource(root, config)
    template, template_file = config.get("chat_template"), Path(f"{cfg_path} (field chat_template)")
    if (root / CHAT_TEMPLATE_FILE).is_file():
        template, template_file = _read_text(root / CHAT_TEMPLATE_FILE), root / CHAT_TEMPLATE_FILE
    elif (root / "chat_template.json").is_file():
        template_file = root / "chat_template.json"
        template = _read_json(template_file).get("chat_template", template)
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{root}: chat_template must be one template string (named templates are not supported)")
    if template:
        check_chat_template(template, template_file)
    src.chat_template = template
    if (root / TIKTOKEN_FILE).is_file():
        src.ranks = read_tiktoken_ranks(root / TIKTOKEN_FILE)
        added = config.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise TokenizerError(f"{cfg_path}: added_tokens_decoder must be an object")
        named: dict[int, str] = {}
        for key, entry in added.items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not str(key).isdigit() or not isinstance(content, str):
                raise TokenizerError(f"{cfg_path}: added_tokens_decoder[{key!r}] needs an integer id and a content")
            named[int(key)] = content
        base = len(src.ranks)
        if vocab_size is not None and base > vocab_size:
            raise TokenizerError(f"{root / TIKTOKEN_FILE}: {base} BPE ranks, more than the model's vocab_size "
                                 f"{vocab_size}")
        too_big = [i for i in named if vocab_size is not None and i >= vocab_size]
        if too_big:  # the same rule as `check_token_ids`, named where the id is
            raise TokenizerError(f"{cfg_path}: added_tokens_decoder id {max(too_big)} ({named[max(too_big)]!r}) is "
                                 f"outside the model's vocab_size {vocab_size}")
        end = vocab_size if vocab_size is not None else base + NUM_RESERVED_SPECIAL_TOKENS
        end = max(end, max(named, default=base - 1) + 1)
        low = [i for i in named if i < base]
        if low:
            raise TokenizerError(f"{cfg_path}: added token id {low[0]} collides with a BPE rank (< {base})")
        src.specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, end)}
        if len(src.specials) != end - base:
            raise TokenizerError(f"{cfg_path}: added_tokens_decoder names two ids alike")
    elif (root / TOKENIZER_JSON).is_file():
        src.tokenizer_json = root / TOKENIZER_JSON
    else:
        raise TokenizerError(f"{root}: no {TIKTOKEN_FILE} or {TOKENIZER_JSON}")
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        name = src.token(key)
        if name is not None and src.ranks is not None and name not in src.specials:
            raise TokenizerError(f"{cfg_path}: {key} {name!r} is not a special token")
    return src


# ---------------------------------------------------------------------------------------------- conversion
def _pre_tokenizer(pattern_or_sequence: str | tuple[str, ...]) -> Any:
    from tokenizers import Regex, pre_tokenizers

    parts = (pattern_or_sequence,) if isinstance(pattern_or_sequence, str) else pattern_or_sequence
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in parts]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_fast_tokenizer(src: TokenizerSource, pattern: str | tuple[str, ...] = KIMI_PATTERN) -> Any:
    """`tokenizers.Tokenizer` of a tiktoken source: transformers' TikTokenConverter BPE (byte level, merges in rank
    order), split by `pattern` (a regex, or a sequence of regexes applied one after the other), with every special
    token at its id."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if src.ranks is None:
        raise TokenizerError(f"{src.root}: not a tiktoken tokenizer")
    ranks = src.ranks
    byte_encoder = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_encoder[c] for c in b)

    vocab = {text(t): r for t, r in ranks.items()}
    # every split of every token into two tokens, by the merged token's rank: BPE then merges the adjacent pair
    # whose concatenation has the lowest rank, as tiktoken does (transformers' TikTokenConverter does the same)
    merges = sorted((rank, ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
                    for token, rank in ranks.items() for i in range(1, len(token))
                    if token[:i] in ranks and token[i:] in ranks)
    tok = Tokenizer(BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = _pre_tokenizer(pattern)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(name, normalized=False, special=True) for name in src.specials])
    for name, i in src.specials.items():
        if tok.token_to_id(name) != i:
            raise TokenizerError(f"{src.root}: special token {name!r} landed at id {tok.token_to_id(name)}, not {i}")
    return tok


def _hf_kwargs(src: TokenizerSource) -> dict[str, Any]:
    kw: dict[str, Any] = {k: src.token(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                          if src.token(k) is not None}
    if src.chat_template:
        kw["chat_template"] = src.chat_template
    kw["clean_up_tokenization_spaces"] = False
    kw["model_max_length"] = int(src.config.get("model_max_length") or 1 << 20)
    return kw


def load_tokenizer(folder: str | os.PathLike[str], vocab_size: int | None = None) -> Any:
    """transformers tokenizer of a checkpoint (tiktoken files, converted in memory) or an export (tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer

    src = read_tokenizer_source(folder, vocab_size)
    if src.ranks is not None:
        return PreTrainedTokenizerFast(tokenizer_object=build_fast_tokenizer(src), **_hf_kwargs(src))
    path = src.tokenizer_json
    text = _read_text(path)  # type: ignore[arg-type]
    check_token_ids(_parse_json(text, path), vocab_size, path)  # type: ignore[arg-type]
    try:
        tok = Tokenizer.from_str(text)  # the text checked, not a re-serialised copy
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for any malformed field
        raise TokenizerError(f"{path}: not a tokenizers tokenizer.json ({str(exc).splitlines()[0]})") from None
    return PreTrainedTokenizerFast(tokenizer_object=tok, **_hf_kwargs(src))


def _genai_unreadable(tokenizer_json: dict[str, Any]) -> bool:
    """Whether onnxruntime-genai 0.18 cannot compile the pre-tokenizer of this tokenizer.json (Kimi's pattern)."""
    text = json.dumps(tokenizer_json.get("pre_tokenizer"))
    return "&&" in text or "\\\\p{Han}" in text


# ---------------------------------------------------------------------------------------------- writers
def copy_tokenizer_files(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer files of checkpoint folder `src` into `dst` (convert): `TOKENIZER_FILES` and
    ``tokenization_*.py`` that exist, as they are. Returns the names copied (empty: the source has none)."""
    s, d = Path(src), Path(dst)
    names = [n for n in TOKENIZER_FILES if (s / n).is_file()]
    names += sorted(p.name for p in s.glob("tokenization_*.py") if p.is_file())
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (s / n).stat().st_size > MAX_TOKENIZER_BYTES:
            raise TokenizerError(f"{s / n}: larger than {MAX_TOKENIZER_BYTES} bytes")
        tmp = d / f".{n}.tmp"
        shutil.copyfile(s / n, tmp)  # follows a Hub cache symlink to its blob
        os.replace(tmp, d / n)
    return names


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _tokenizer_config(src: TokenizerSource, tok_json: dict[str, Any], inline_template: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **_hf_kwargs(src)}
    cfg.pop("chat_template", None)
    if inline_template and src.chat_template:
        cfg["chat_template"] = src.chat_template  # onnxruntime-genai reads it from here or chat_template.jinja
    cfg["added_tokens_decoder"] = {
        str(t["id"]): {"content": t["content"], "lstrip": t.get("lstrip", False), "normalized": t.get("normalized",
                       False), "rstrip": t.get("rstrip", False), "single_word": t.get("single_word", False),
                       "special": t.get("special", True)}
        for t in tok_json.get("added_tokens", [])}
    return cfg


def write_export_tokenizer(src: str | os.PathLike[str], export_dir: str | os.PathLike[str],
                           vocab_size: int | None = None) -> list[str]:
    """Write the tokenizer of checkpoint folder `src` into `export_dir` (export): ``tokenizer.json``,
    ``tokenizer_config.json`` and ``chat_template.jinja`` for transformers (and onnxruntime-genai when it can read
    them), else also ``genai_tokenizer/`` (module docstring). `vocab_size`: the model's, which bounds the special
    tokens of a tiktoken BPE. Returns the relative paths written; empty when `src` has no tokenizer."""
    if not has_tokenizer(src):
        return []
    source = read_tokenizer_source(src, vocab_size)
    root = Path(export_dir)
    root.mkdir(parents=True, exist_ok=True)
    fast = build_fast_tokenizer(source) if source.ranks is not None else None
    if fast is not None:
        tok_json = json.loads(fast.to_str())
    else:
        tok_json = _read_json(source.tokenizer_json)  # type: ignore[arg-type]
    check_token_ids(tok_json, vocab_size, source.tokenizer_json or src)
    written = [TOKENIZER_JSON, TOKENIZER_CONFIG]
    _write_json(root / TOKENIZER_JSON, tok_json)
    _write_json(root / TOKENIZER_CONFIG, _tokenizer_config(source, tok_json, inline_template=False))
    if source.chat_template:
        _write_text(root / CHAT_TEMPLATE_FILE, source.chat_template)
        written.append(CHAT_TEMPLATE_FILE)
    if _genai_unreadable(tok_json):
        if fast is None:
            raise TokenizerError(f"{source.tokenizer_json}: its pre-tokenizer is Kimi's, which onnxruntime-genai "
                                 f"cannot compile; give the source's {TIKTOKEN_FILE} so k3export can write one it can")
        fast.pre_tokenizer = _pre_tokenizer(GENAI_KIMI_SEQUENCE)
        genai_json = json.loads(fast.to_str())
        _write_json(root / GENAI_TOKENIZER_DIR / TOKENIZER_JSON, genai_json)
        _write_json(root / GENAI_TOKENIZER_DIR / TOKENIZER_CONFIG,
                    _tokenizer_config(source, genai_json, inline_template=True))
        written += [f"{GENAI_TOKENIZER_DIR}/{TOKENIZER_JSON}", f"{GENAI_TOKENIZER_DIR}/{TOKENIZER_CONFIG}"]
    return written


# ---------------------------------------------------------------------------------------------- the tiny model's
#: the tiny model's special tokens: pad / bos / eos at the config's ids, then Kimi's chat markers at the next free ids
TINY_SPECIALS = ("[PAD]", "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>")
#: the text the tiny BPE learns its merges from (fixed: the same tokenizer on every run)
_TINY_CORPUS = """\
Hello! This is a tiny Kimi K3 model with random weights, made on the spot to show every step of k3export. \
It reads text, turns it into tokens, runs them through linear attention and latent attention layers, and the \
experts of each layer, then writes new tokens back as text. The words it writes mean nothing yet: its weights \
are random. The same steps run the released model, which is far larger. Export the model to ONNX, validate it \
against PyTorch, build a TensorRT engine, and generate text with each runtime. The quick brown fox jumps over \
the lazy dog. What would you like to know about the model? Tell me a story about the sea, the stars and the \
mountains. Once upon a time there was a small model that wanted to speak. It learned one word at a time, and \
then another, until it could say hello to everyone it met. Numbers like 1, 2, 3, 10, 42 and 2048 are tokens \
too, and so are spaces, commas, and new lines.
def forward(self, hidden_states):
    return self.mlp(self.norm(hidden_states)) + hidden_states
"""


def _learn_merges(pieces: dict[str, int], tokens: int) -> list[tuple[str, str]]:
    """BPE merges learnt from word counts `pieces` (byte-level strings) until they make `tokens` new tokens: each
    time the most frequent adjacent pair, ties to the larger pair, so the result never depends on dict or hash
    order. (Two merges may make the same token, "a"+"bc" and "ab"+"c": it is counted once.)"""
    words = {w: list(w) for w in pieces}
    merges: list[tuple[str, str]] = []
    made: set[str] = set()
    while len(made) < tokens:
        pairs: dict[tuple[str, str], int] = {}
        for w, n in pieces.items():
            s = words[w]
            for pair in zip(s, s[1:]):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            raise TokenizerError(f"the tiny tokenizer's corpus has no pairs left after {len(merges)} merges")
        a, b = max(pairs, key=lambda pair: (pairs[pair], pair))
        merges.append((a, b))
        made.add(a + b)
        for w, s in words.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            words[w] = out
    return merges


def build_tiny_tokenizer(vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` ids for a tiny model: `TINY_SPECIALS` (pad /
    bos / eos at the given ids), the 256 bytes, then merges learnt from a fixed English text, split as
    ``genai_tokenizer/`` splits (`GENAI_KIMI_SEQUENCE`), so transformers and onnxruntime-genai encode alike.
    Deterministic: every call gives the same tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    roles = {pad_token_id: "[PAD]", bos_token_id: "[BOS]", eos_token_id: "[EOS]"}
    if len(roles) != 3 or not all(0 <= i < vocab_size for i in roles):
        raise TokenizerError(f"tiny tokenizer: pad / bos / eos ids {pad_token_id} / {bos_token_id} / {eos_token_id} "
                             f"must be three different ids below vocab_size {vocab_size}")
    free = (i for i in range(vocab_size) if i not in roles)
    specials = dict(roles) | {next(free): name for name in TINY_SPECIALS if name not in roles.values()}
    byte_chars = list(bytes_to_unicode().values())
    if vocab_size < len(specials) + len(byte_chars):
        raise TokenizerError(f"tiny tokenizer: vocab_size {vocab_size} holds no byte-level BPE "
                             f"({len(specials)} special tokens + 256 bytes)")
    pre_tokenizer = _pre_tokenizer(GENAI_KIMI_SEQUENCE)
    pieces: dict[str, int] = {}
    for piece, _ in pre_tokenizer.pre_tokenize_str(_TINY_CORPUS):
        pieces[piece] = pieces.get(piece, 0) + 1
    merges = _learn_merges(pieces, vocab_size - len(specials) - len(byte_chars))
    ids = (i for i in range(vocab_size) if i not in specials)
    vocab = {name: i for i, name in specials.items()}
    for token in [*byte_chars, *(a + b for a, b in merges)]:
        if token not in vocab:
            vocab[token] = next(ids, vocab_size)
    if sorted(vocab.values()) != list(range(vocab_size)):  # only if a merge spelt a special token's name
        raise TokenizerError(f"tiny tokenizer: its {len(vocab)} tokens do not fill ids 0..{vocab_size - 1}")
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(name, normalized=False, special=True)
                            for _, name in sorted(specials.items())])
    return tok


def tiny_chat_template() -> str:
    """The chat template of the tiny checkpoints (``k3export tiny``, with or without ``--vision``; `convert` and
    `export` carry it): Kimi's turn format, ``<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>``. A string
    content is written as it is; an OpenAI-style list of parts, in order: each text part as its text, each image
    part (``image`` / ``image_url``) as the processor's image placeholder and each video part (``video`` /
    ``video_url``) as its video placeholder (`K3Processor` expands them), as K3's and Kimi K2.5's published
    templates write a media placeholder per image part. Any other part type raises instead of vanishing from the
    prompt. transformers and onnxruntime-genai render it alike."""
    from k3export.modeling.image_processing_k3 import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

    return (
        "{%- for message in messages -%}"
        "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- elif message['content'] is not none -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
        f"{{%- elif part['type'] == 'image' or part['type'] == 'image_url' -%}}{IMAGE_PLACEHOLDER}"
        f"{{%- elif part['type'] == 'video' or part['type'] == 'video_url' -%}}{VIDEO_PLACEHOLDER}"
        "{%- else -%}{{ raise_exception('a message part of type ' ~ part['type'] ~ ': this chat template renders "
        "text, image and video parts') }}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}<|im_end|>"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def write_tiny_tokenizer(folder: str | os.PathLike[str], config: Any) -> list[str]:
    """Write `build_tiny_tokenizer` for `config` (a tiny `K3Config`: its vocab_size and pad / bos / eos ids) into
    `folder`: ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` (`tiny_chat_template`),
    the files `read_tokenizer_source` reads. Returns the names written."""
    ids = {"pad_token": int(config.pad_token_id), "bos_token": int(config.bos_token_id),
           "eos_token": int(config.eos_token_id)}
    tok = build_tiny_tokenizer(int(config.vocab_size), *ids.values())
    root = Path(folder)
    tok_json = json.loads(tok.to_str())
    settings = {key: tok.id_to_token(i) for key, i in ids.items()} | {"model_max_length": 1 << 20}
    template = tiny_chat_template()
    source = TokenizerSource(root, settings, chat_template=template)
    _write_json(root / TOKENIZER_JSON, tok_json)
    _write_json(root / TOKENIZER_CONFIG, _tokenizer_config(source, tok_json, inline_template=False))
    _write_text(root / CHAT_TEMPLATE_FILE, template)
    return [TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE]


# ---------------------------------------------------------------------------------------------- chat
def chat_messages(prompt: str, images: int = 0) -> list[dict[str, Any]]:
    """`prompt` as one user turn, the messages a chat template renders: its content the string itself, or, with
    `images`, an OpenAI-style list of that many image parts, then the text (the template writes each image part's
    placeholder)."""
    if not images:
        return [{"role": "user", "content": prompt}]
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": prompt}]}]


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """`messages` through the tokenizer's chat template (the one renderer of generate --chat, chat and cache); one
    line for a tokenizer without a template or a template that fails on them."""
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError("this tokenizer has no chat template (a chat needs one)")
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except jinja2.TemplateError as exc:  # parsed when loaded (`check_chat_template`): this is the template's own
        raise TokenizerError(f"the chat template failed on the conversation: {exc}") from None


def chat_prompt(tokenizer: Any, prompt: str, images: int = 0) -> str:
    """`prompt` as one user turn (`chat_messages`, `images` image parts in front of the text) through the
    tokenizer's chat template, ready for the assistant's reply. A template that writes fewer image placeholders
    than image parts is refused here: the processor could only say the prompt lacks them."""
    text = render_chat(tokenizer, chat_messages(prompt, images))
    if images:
        from k3export.modeling.image_processing_k3 import IMAGE_PLACEHOLDER

        written = text.count(IMAGE_PLACEHOLDER) - prompt.count(IMAGE_PLACEHOLDER)
        if written < images:
            raise TokenizerError(f"the chat template wrote {written} {IMAGE_PLACEHOLDER} for {images} image parts: it "
                                 "renders no image parts (a checkpoint of an older `k3export tiny`: make it again), "
                                 f"or put {IMAGE_PLACEHOLDER} in the prompt where each image goes")
    return text


__all__ = [
    "CHAT_TEMPLATE_FILE", "GENAI_DIFFERENCES", "GENAI_KIMI_SEQUENCE", "GENAI_TOKENIZER_DIR", "KIMI_PATTERN",
    "TIKTOKEN_FILE", "TINY_SPECIALS", "TOKENIZER_CONFIG", "TOKENIZER_FILES", "TOKENIZER_JSON", "TokenizerError",
    "TokenizerSource", "build_fast_tokenizer", "build_tiny_tokenizer", "chat_messages", "chat_prompt",
    "check_chat_template", "check_token_ids", "copy_tokenizer_files", "has_tokenizer", "load_tokenizer", "render_chat",
    "read_tiktoken_ranks", "read_tokenizer_source", "tiny_chat_template", "write_export_tokenizer",
    "write_tiny_tokenizer",
]
