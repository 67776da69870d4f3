"""Helpers of the onnxruntime-genai tests: a Kimi-style tiktoken tokenizer made on the spot (the repository ships
none), the tokenizer as tiktoken runs it, and an export with everything `k3export export` writes for genai."""

from __future__ import annotations

import base64
import collections
import json
import random
from pathlib import Path

import pytest

VOCAB = 512
#: Kimi's special tokens (names as released), at offsets from the first id after the BPE ranks
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
            7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 17: "<|im_middle|>"}
#: a Kimi-style chat template (system prompt when none is given; role markers; <|im_end|> after every turn)
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant.<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")

TEXT = (
    "The quick brown fox jumps over the lazy dog. It's 2026 and we're exporting Kimi K3 to ONNX! "
    "Hello world, hello model; the model says hello. 你好世界，这是一个测试。我们的模型支持中文。 "
    "Ünïcödé façade naïve café. def forward(self, x):\n    return self.proj(x) * 2\n\n"
    "You are Kimi, an AI assistant. user assistant system tokenizer export runtime genai 12345 67890 "
)


def _corpus(seed: int) -> str:
    rng = random.Random(seed)
    syllables = ["ka", "ki", "mo", "ex", "port", "ing", "er", "th", "the", "on", "an", "re", "in", "tion", "st",
                 "al", "de", "co", "ro", "ne", "ma", "ti"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(1500)]
    return TEXT * 8 + " ".join(w.capitalize() if rng.random() < 0.2 else w for w in words)


def train_tiktoken_ranks(n_ranks: int, seed: int = 0) -> dict[bytes, int]:
    """Byte-level BPE ranks (256 bytes + merges) learnt on a small corpus split by Kimi's pattern."""
    from tokenizers import Regex, pre_tokenizers

    from k3export.tokenizer import KIMI_PATTERN

    split = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")
    pieces = collections.Counter(p for p, _ in split.pre_tokenize_str(_corpus(seed)))
    ranks = {bytes([i]): i for i in range(256)}
    seqs = {w: [bytes([b]) for b in w.encode()] for w in pieces}
    while len(ranks) < n_ranks:
        pairs: collections.Counter = collections.Counter()
        for w, c in pieces.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def write_kimi_tokenizer(folder: Path, n_ranks: int = 440, seed: int = 0) -> dict[str, int]:
    """``tiktoken.model`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``) laid out as Kimi ships them;
    returns {special token: id}."""
    folder.mkdir(parents=True, exist_ok=True)
    ranks = train_tiktoken_ranks(n_ranks, seed)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    specials = {name: base + off for off, name in SPECIALS.items()}
    specials["[UNK]"], specials["[PAD]"] = VOCAB - 2, VOCAB - 1
    added = {str(i): {"content": n, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for n, i in sorted(specials.items(), key=lambda kv: kv[1])}
    config = {"added_tokens_decoder": added, "additional_special_tokens": ["<|im_end|>", "<|im_user|>",
              "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>",
              "<|im_middle|>"], "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
              "unk_token": "[UNK]", "clean_up_tokenization_spaces": False, "model_max_length": 1048576,
              "tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return specials


def tiktoken_encoding(folder: Path, vocab: int = VOCAB):
    """The tokenizer as tiktoken runs it (the released tokenization_kimi.py does exactly this)."""
    tiktoken = pytest.importorskip("tiktoken")
    from k3export.tokenizer import KIMI_PATTERN, read_tokenizer_source

    src = read_tokenizer_source(folder, vocab)
    return tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=src.ranks,
                             special_tokens=src.specials)


def export_for_genai(model, checkpoint: Path | None, out: Path, form: str | None = None) -> Path:
    """ONNX export (in graph `form`) + tokenizer + genai_config.json (the three writes `k3export export` makes)."""
    from k3export.converters.onnx import export_onnx
    from k3export.genai import write_genai_config
    from k3export.tokenizer import write_export_tokenizer

    export_onnx(model, out, dtype="fp32", form=form)
    if checkpoint is not None:
        write_export_tokenizer(checkpoint, out, vocab_size=model.config.vocab_size)
    write_genai_config(out, model.config)
    return out
