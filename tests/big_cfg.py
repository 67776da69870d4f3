"""The benchmark model of the speed issues (bench/big_cfg.json, a copy of ../shared/bench/big_cfg.json kept in the
repository so CI has it): its fields over `K3Config.tiny()`, every K3 feature on, as bench/peers.py reads it."""

from __future__ import annotations

import json
from pathlib import Path

BIG_CFG = Path(__file__).resolve().parents[1] / "bench" / "big_cfg.json"


def big_config():
    from k3export.modeling import K3Config

    over = json.loads(BIG_CFG.read_text())
    lac = dict(K3Config.tiny().linear_attn_config)
    lac.update(over.get("linear_attn_config") or {})
    return K3Config.tiny(**{**over, "linear_attn_config": lac})
