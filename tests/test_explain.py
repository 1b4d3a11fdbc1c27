"""attnzoo.explain checks its arguments exactly as the variant's function does: an unknown keyword is a
TypeError naming it (with the closest one the function takes), an unknown variant a ValueError with a
suggestion, and a bad option value the function's own error."""
import pytest
import torch

import attnzoo
import attnzoo.functional as AF

Q = torch.randn(1, 2, 5, 4)


@pytest.mark.parametrize("variant,bad,close", [("sinkhorn", "n_iter", "n_iters"), ("l2", "foo", None),
                                               ("sigmoid", "biass", "bias"), ("softmax", "is_casual", "is_causal")])
def test_unknown_keywords_are_refused_like_the_function_refuses_them(variant, bad, close):
    with pytest.raises(TypeError) as by_function:
        getattr(AF, variant)(Q, Q, Q, **{bad: 1})
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{bad}'") as by_explain:
        attnzoo.explain(variant, Q, Q, Q, **{bad: 1})
    assert bad in str(by_function.value)
    if close:
        assert f"did you mean '{close}'" in str(by_explain.value)


def test_an_unknown_variant_gets_a_suggestion():
    with pytest.raises(ValueError, match="did you mean 'softmax'"):
        attnzoo.explain("softmaxx", Q, Q, Q)


@pytest.mark.parametrize("variant,kwargs,error,match", [
    ("sinkhorn", {"n_iters": -1}, ValueError, "n_iters must be an int >= 0"),
    ("linear", {"feature_map": "elu1"}, ValueError, "did you mean 'elu'"),
    ("fenchel", {"alpha": 0.0}, ValueError, "alpha must be finite and > 0"),
])
def test_bad_option_values_get_the_functions_error(variant, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(AF, variant)(Q, Q, Q, **kwargs)
    with pytest.raises(error, match=match):
        attnzoo.explain(variant, Q, Q, Q, **kwargs)


def test_good_options_are_explained():
    choice = attnzoo.explain("sinkhorn", Q, Q, Q, n_iters=5, eps=0.5, is_causal=True)
    assert choice.backend.name in ("reference", "cpu") and "sinkhorn: runs" in str(choice)
