"""Initializer names of the tiny model's ONNX export that tests edit (`k3export.modeling.tiny_model`: layer 3 is
KDA)."""

#: layer 3's input projections, q, k, v, the forget gate's first factor, beta and the output gate, joined into one
#: product (`GraphBuilder.merge_projections`)
KDA_IN_PROJ = "model.layers.3.self_attn.qkv_proj+f_a_proj+b_proj+g_proj.weight"
