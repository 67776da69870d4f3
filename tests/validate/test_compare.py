import numpy as np
import pytest

from k3export.errors import K3ExportError
from k3export.validate import Tolerances, compare
from k3export.validate.compare import DEFAULT_TOLERANCES


def test_identical_tensors_pass_with_zero_error():
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    m = compare(x, x, "logits", Tolerances().for_kind("logits"))
    assert m.passed and m.max_abs == 0 and m.rms_rel == 0 and m.cosine == pytest.approx(1.0)
    assert m.top1 == 1.0 and m.topk == 1.0 and m.top1_unexcused == 0


def test_metrics_values():
    r = np.array([1.0, -2.0, 2.0, 0.0])
    x = r + np.array([0.1, 0.0, 0.0, 0.0])
    m = compare(x, r, "latent", Tolerances().for_kind("latent"))
    assert m.max_abs == pytest.approx(0.1)
    assert m.rms_rel == pytest.approx(0.1 / 3.0)
    assert m.max_rel == pytest.approx(0.1)
    assert not m.passed and "rms_rel" in m.reason


def test_non_finite_and_shape_mismatch_fail():
    r = np.ones((2, 2))
    x = r.copy()
    x[0, 0] = np.nan
    m = compare(x, r, "recurrent_state", Tolerances().for_kind("recurrent_state"))
    assert not m.passed and not m.finite and "non-finite" in m.reason
    m = compare(np.ones((2, 3)), r, "latent", Tolerances().for_kind("latent"))
    assert not m.passed and "shape" in m.reason


def test_top1_near_tie_is_excused_but_real_flip_is_not():
    r = np.array([[[1.0, 1.0 + 1e-7, -3.0]]])
    x = np.array([[[1.0 + 2e-7, 1.0, -3.0]]])  # argmax flips inside the measured error: a tie
    m = compare(x, r, "logits", Tolerances().for_kind("logits"))
    assert m.top1 == 0.0 and m.top1_unexcused == 0 and m.passed
    # a clear preference of the reference (gap 0.5) flipped: far outside the near-tie margin
    r2 = np.array([[[1.0, 1.5, -3.0, 2.0, -2.0, 0.5, 1.2, -1.0]]])
    x2 = r2.copy()
    x2[0, 0, 3] = 1.4  # the reference's best (2.0) drops below the runner-up (1.5)
    m2 = compare(x2, r2, "logits", Tolerances().for_kind("logits"))
    assert m2.top1 == 0.0 and m2.top1_unexcused == 1 and not m2.passed and "top-1" in m2.reason
    # a flip within 8 * rms_rel tolerance * rms(row) is a near tie
    tiny = np.array([[[1.0, 1.0 + 1e-6, -3.0]]])
    m4 = compare(np.array([[[1.0 + 1e-6, 1.0, -3.0]]]), tiny, "logits", Tolerances().for_kind("logits"))
    assert m4.top1_unexcused == 0 and m4.passed


def test_tolerance_parse_and_dtype_defaults():
    t = Tolerances.parse(["logits=1e-2", "latent.max_abs_rel=0.5", "*.atol=1e-3"], "bfloat16")
    assert t.for_kind("logits").rms_rel == 1e-2
    assert t.for_kind("latent").max_abs_rel == 0.5
    assert t.for_kind("conv_state").atol == 1e-3
    assert t.for_kind("conv_state").rms_rel == DEFAULT_TOLERANCES["bfloat16"].rms_rel
    assert DEFAULT_TOLERANCES["bfloat16"].rms_rel > DEFAULT_TOLERANCES["float16"].rms_rel > \
        DEFAULT_TOLERANCES["float32"].rms_rel
    for bad, msg in (("nokind=1", "unknown tensor kind"), ("logits", "KIND=VALUE"), ("logits=x", "not a number"),
                     ("logits.foo=1", "unknown metric"), ("logits=-1", ">= 0")):
        with pytest.raises(K3ExportError, match=msg):
            Tolerances.parse([bad])


@pytest.mark.parametrize("spec", ["*=1e308", "logits=inf", "latent.max_abs_rel=2"])
def test_meaningless_tolerance_overrides_are_refused_unless_forced(spec):
    with pytest.raises(K3ExportError, match="--force"):
        Tolerances.parse([spec])
    assert Tolerances.parse([spec], force=True).overrides


def test_nan_tolerance_is_refused_even_forced():
    with pytest.raises(K3ExportError, match="must be a number"):
        Tolerances.parse(["logits.atol=nan"], force=True)
