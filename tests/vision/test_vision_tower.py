"""MoonViT-V2 tower + PatchMergerMLPV2 projector (fp32) against a float64 reference written here, one image at a time,
one patch / head / block at a time (explicit conv sums, hand-written bilinear resampling, complex-number rotary,
explicit softmax), never through the packed path or the modules' helpers."""

from __future__ import annotations

import math

import pytest
import torch

from k3export.modeling import K3VisionConfig, tiny_vision_model
from k3export.modeling.modeling_k3_vision import K3VisionInputError

# ------------------------------------------------------------------------------------------- the reference


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _bilinear(grid: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[H0, W0, D] -> [rows, cols, D], half-pixel centres, edge-clamped (the textbook definition, written out)."""
    h0, w0, _ = grid.shape
    out = torch.empty(rows, cols, grid.shape[-1], dtype=grid.dtype)
    for r in range(rows):
        fy = max((r + 0.5) * h0 / rows - 0.5, 0.0)
        y0 = min(int(math.floor(fy)), h0 - 1)
        y1, wy = min(y0 + 1, h0 - 1), fy - y0
        for c in range(cols):
            fx = max((c + 0.5) * w0 / cols - 0.5, 0.0)
            x0 = min(int(math.floor(fx)), w0 - 1)
            x1, wx = min(x0 + 1, w0 - 1), fx - x0
            out[r, c] = ((1 - wy) * (1 - wx) * grid[y0, x0] + (1 - wy) * wx * grid[y0, x1]
                         + wy * (1 - wx) * grid[y1, x0] + wy * wx * grid[y1, x1])
    return out


def _rotate(v: torch.Tensor, col: int, row: int) -> torch.Tensor:
    """One head vector [hd]: pairs (2j, 2j+1) as complex numbers times e^(i * angle), angle = (col if j even else
    row) * 10000^(-4 * (j // 2) / hd)."""
    hd = v.shape[0]
    z = torch.complex(v[0::2], v[1::2])
    j = torch.arange(hd // 2, dtype=torch.float64)
    pos = torch.where(j % 2 == 0, torch.tensor(float(col), dtype=torch.float64),
                      torch.tensor(float(row), dtype=torch.float64))
    ang = pos * 10000.0 ** (-4 * torch.div(j, 2, rounding_mode="floor") / hd)
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.stack([z.real, z.imag], -1).reshape(hd)


def reference_image(weights: dict[str, torch.Tensor], cfg: K3VisionConfig, pixels: torch.Tensor,
                    grid: tuple[int, int, int]) -> torch.Tensor:
    """One image (or video chunk) [t*h*w, C, p, p] -> its projected tokens [(h/kh)*(w/kw), text hidden]."""
    w = {k: v.double() for k, v in weights.items()}
    eps = torch.finfo(torch.float32).eps  # the fp32 tower's norm epsilon (the activation dtype's)
    t, h, wd = grid
    d, heads, hd = cfg.vt_hidden_size, cfg.vt_num_attention_heads, cfg.head_dim
    px = pixels.double()
    conv = w["vision_tower.patch_embed.proj.weight"]  # [D, C, p, p]
    x = torch.stack([(conv * px[i]).sum(dim=(1, 2, 3)) for i in range(px.shape[0])])
    pos = w["vision_tower.patch_embed.pos_emb.weight"]
    spatial = pos if pos.shape[:2] == (h, wd) else _bilinear(pos, h, wd)
    for f in range(t):
        for r in range(h):
            for c in range(wd):
                e = spatial[r, c].clone()
                if t > 1:
                    k = torch.arange(d // 2, dtype=torch.float64)
                    om = 10000.0 ** (-k / (d / 2))
                    e = e + torch.cat([torch.sin(f * om), torch.cos(f * om)])
                x[(f * h + r) * wd + c] += e
    coords = [(c, r) for f in range(t) for r in range(h) for c in range(wd)]
    n = x.shape[0]
    for b in range(cfg.vt_num_hidden_layers):
        pre = f"vision_tower.encoder.blocks.{b}."
        y = _rms(x, w[pre + "norm0.weight"], eps)
        qkv = (y @ w[pre + "wqkv.weight"].T).reshape(n, 3, heads, hd)
        att = torch.empty(n, heads, hd, dtype=torch.float64)
        for hh in range(heads):
            q = torch.stack([_rotate(qkv[i, 0, hh], *coords[i]) for i in range(n)])
            k = torch.stack([_rotate(qkv[i, 1, hh], *coords[i]) for i in range(n)])
            s = q @ k.T / math.sqrt(hd)
            p = torch.exp(s - s.max(-1, keepdim=True).values)
            att[:, hh] = (p / p.sum(-1, keepdim=True)) @ qkv[:, 2, hh]
        x = x + att.reshape(n, heads * hd) @ w[pre + "wo.weight"].T
        y = _rms(x, w[pre + "norm1.weight"], eps)
        u = y @ w[pre + "mlp.fc0.weight"].T
        u = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + u @ w[pre + "mlp.fc1.weight"].T
    x = _rms(x, w["vision_tower.encoder.final_layernorm.weight"], eps).reshape(t, h, wd, d)
    kh, kw = cfg.merge_kernel_size
    tokens = []
    for br in range(h // kh):
        for bc in range(wd // kw):
            block = [x[:, br * kh + i, bc * kw + j].mean(0) for i in range(kh) for j in range(kw)]
            tokens.append(torch.cat(block))
    m = torch.stack(tokens) @ w["mm_projector.proj.0.weight"].T
    m = 0.5 * m * (1 + torch.erf(m / math.sqrt(2)))
    m = m @ w["mm_projector.proj.2.weight"].T
    return _rms(m, w["mm_projector.post_norm.weight"], cfg.projector_ln_eps)


# ------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def model():
    return tiny_vision_model(seed=1)


# grids (frames, rows, columns): the stored 6x6 position grid as is, a smaller one, a wider one, a 2-frame chunk
GRIDS = [(1, 6, 6), (1, 2, 4), (1, 4, 10), (2, 4, 2)]


def test_tower_and_projector_match_float64_reference(model):
    cfg = model.config.vision_config
    gen = torch.Generator().manual_seed(0)
    pixels = [torch.randn(t * h * w, 3, cfg.patch_size, cfg.patch_size, generator=gen) for t, h, w in GRIDS]
    with torch.no_grad():
        got = model.get_image_features(torch.cat(pixels), torch.tensor(GRIDS))
    weights = {k: v.detach() for k, v in model.named_parameters() if k.startswith(("vision_tower.", "mm_projector."))}
    want = torch.cat([reference_image(weights, cfg, px, g) for px, g in zip(pixels, GRIDS)])
    assert got.dtype == torch.float32 and got.shape == want.shape == (9 + 2 + 10 + 2, cfg.text_hidden_size)
    err = (got.double() - want).abs().max().item()
    assert err < 1e-5, f"max abs error {err:.2e} against the float64 reference"
    assert want.abs().max() > 0.5  # O(1) outputs: the tolerance means something


def test_images_in_a_pack_do_not_see_each_other(model):
    """Changing one image's pixels leaves the other images' tokens unchanged (per-image attention)."""
    cfg = model.config.vision_config
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(1 * 2 * 4, 3, cfg.patch_size, cfg.patch_size, generator=gen)
    b = torch.randn(1 * 4 * 4, 3, cfg.patch_size, cfg.patch_size, generator=gen)
    grids = torch.tensor([[1, 2, 4], [1, 4, 4]])
    with torch.no_grad():
        one = model.get_image_features(torch.cat([a, b]), grids)
        two = model.get_image_features(torch.cat([a, b + 1.0]), grids)
    assert torch.equal(one[:2], two[:2]) and not torch.allclose(one[2:], two[2:])


@pytest.mark.parametrize("grid, phrase", [
    ([[1, 3, 4]], "multiples of the merge kernel"),
    ([[3, 2, 2]], "init_pos_emb_time = 2"),
    ([[1, 2, 2], [1, 2, 2]], "covers 8 patches but pixel_values has 4"),
    ([[1, 2]], "three positive integers"),
])
def test_bad_grids_are_refused_in_one_line(model, grid, phrase):
    cfg = model.config.vision_config
    pixels = torch.zeros(4 if grid != [[3, 2, 2]] else 12, 3, cfg.patch_size, cfg.patch_size)
    with pytest.raises(K3VisionInputError, match=phrase) as info:
        model.get_image_features(pixels, grid)
    assert "\n" not in str(info.value)


def test_pixels_of_the_wrong_patch_shape_are_refused(model):
    with pytest.raises(K3VisionInputError, match=r"pixel_values must be \[patches, 3, 4, 4\]"):
        model.get_image_features(torch.zeros(4, 3, 14, 14), [[1, 2, 2]])
