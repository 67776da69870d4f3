"""genai_config.json is written once from the contract, loads in onnxruntime-genai unchanged, and the genai-facing
checks name what genai would refuse or misread."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

og = pytest.importorskip("onnxruntime_genai")


def test_config_is_derived_from_the_contract(tok_model):
    from k3export.genai import GREEDY_SEARCH, genai_config
    from k3export.modeling import K3Config, contract

    for config in (tok_model.config, K3Config.tiny_kimi_linear(), K3Config.k3()):
        cfg = genai_config(config)
        dec = cfg["model"]["decoder"]
        assert cfg["model"]["type"] == "decoder" and cfg["model"]["vocab_size"] == config.vocab_size
        assert cfg["model"]["eos_token_id"] == [config.eos_token_id]
        kv = next(s for s in contract.state_specs(config) if s.kind == "key")
        assert (dec["num_key_value_heads"], dec["head_size"]) == (kv.shape[1], kv.shape[3])
        assert dec["inputs"]["past_conv_names"] % 0 == contract.STATE_INPUT.format(layer=0, kind="conv_state")
        assert dec["outputs"]["present_recurrent_names"] % 3 == contract.STATE_OUTPUT.format(layer=3,
                                                                                            kind="recurrent_state")
        assert dec["inputs"]["attention_mask"] == contract.ATTENTION_MASK and dec["outputs"]["logits"] == \
            contract.LOGITS
        assert {k: cfg["search"][k] for k in GREEDY_SEARCH} == GREEDY_SEARCH and not cfg["search"]["do_sample"]


def test_written_config_loads_and_checks(tok_export):
    from k3export.genai import check_export

    cfg = check_export(tok_export)
    assert cfg["model"]["decoder"]["session_options"]["enable_mem_pattern"] is False  # genai reads this key
    assert og.Model(str(tok_export)).type == "decoder"
    assert cfg["search"]["past_present_share_buffer"] is False


def test_genai_is_strict_about_keys(tok_export, tmp_path):
    """The fact the writer is built around: an unknown key fails the load (so the writer writes known keys only)."""
    export = tmp_path / "e"
    shutil.copytree(tok_export, export)
    cfg = json.loads((export / "genai_config.json").read_text())
    cfg["model"]["decoder"]["past_state_names"] = "past_key_values.%d.state"
    (export / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="past_state_names"):
        og.Model(str(export))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["model"].__setitem__("type", "k3"), "model.type"),
    (lambda c: c["search"].__setitem__("past_present_share_buffer", True), "past_present_share_buffer"),
    (lambda c: c["model"]["decoder"].__setitem__("filename", "../model.onnx"), "decoder.filename"),
    (lambda c: c["model"]["decoder"]["inputs"].__setitem__("past_conv_names", "past_key_values.%d.conv"),
     "every KV layer needs"),
    (lambda c: c["model"]["decoder"]["inputs"].__setitem__("past_key_names", "past.%d.k"), "every KV layer needs"),
    (lambda c: c["model"]["decoder"].__setitem__("head_size", 7), "head_size"),
    (lambda c: c["model"]["decoder"]["outputs"].__setitem__("present_key_names", "present.%d"), "has no output"),
    (lambda c: c["model"].__setitem__("tokenizer_dir", "../tok"), "tokenizer_dir"),
])
def test_check_export_names_the_problem(tok_export, tmp_path, edit, message):
    from k3export.genai import GenaiError, check_export

    export = tmp_path / "e"
    shutil.copytree(tok_export, export)
    cfg = json.loads((export / "genai_config.json").read_text())
    edit(cfg)
    (export / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(GenaiError, match=message):
        check_export(export)


def test_check_contract_rules(tok_model, monkeypatch):
    from k3export import genai
    from k3export.modeling import contract

    genai.check_contract(tok_model.config)
    real = contract.layer_state_specs

    def two_conv_states(config, layer):  # a KDA layer with q/k/v conv states apart: genai allows one
        specs = real(config, layer)
        if specs[0].role != "conv":
            return specs
        c = specs[0]
        return [contract.StateSpec(layer, "conv_state", "conv", c.shape, c.dtype),
                contract.StateSpec(layer, "conv_state_k", "conv", c.shape, c.dtype), *specs[1:]]

    monkeypatch.setattr(contract, "layer_state_specs", two_conv_states)
    with pytest.raises(genai.GenaiError, match="conv_state_k"):
        genai.check_contract(tok_model.config)


def test_writer_is_the_one_source(tok_model, tmp_path):
    from k3export.genai import GENAI_TOKENIZER_DIR, genai_config, read_genai_config, write_genai_config

    (tmp_path / GENAI_TOKENIZER_DIR).mkdir()
    write_genai_config(tmp_path, tok_model.config, context_length=4096)
    got = read_genai_config(tmp_path)
    want = genai_config(tok_model.config, context_length=4096, tokenizer_dir=GENAI_TOKENIZER_DIR)
    assert got == want and got["search"]["max_length"] == 4096
    bad = copy.deepcopy(tok_model.config)
    bad.eos_token_id = None
    with pytest.raises(Exception, match="eos_token_id"):
        genai_config(bad)


def test_kda_only_model_runs_in_genai(tmp_path):
    """A model without MLA layers (no KV cache at all) runs too: genai finds only recurrent layers."""
    import numpy as np
    import torch

    from genai_fixtures import export_for_genai
    from k3export.modeling import K3Config, K3ForCausalLM, randomize_weights

    lac = dict(K3Config.tiny().linear_attn_config)
    lac.update(kda_layers=list(range(1, 7)), full_attn_layers=[])
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.tiny(linear_attn_config=lac)).eval()
    randomize_weights(model, 0)
    export = export_for_genai(model, None, tmp_path / "kda")
    gen_model = og.Model(str(export))
    params = og.GeneratorParams(gen_model)
    params.set_search_options(max_length=20)
    gen = og.Generator(gen_model, params)
    gen.append_tokens(np.array([[5, 6, 7, 8]], np.int32))
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    with torch.no_grad():
        want = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=len(got), do_sample=False,
                              eos_token_id=None)[0, 4:].tolist()
    cut = got.index(model.config.eos_token_id) + 1 if model.config.eos_token_id in got else len(got)
    assert got[:cut] == want[:cut]
