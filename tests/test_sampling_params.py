import dataclasses

import pytest

from moeserve.sampling_params import SamplingParams


def test_defaults_are_valid_and_sample():
    p = SamplingParams()
    assert p.max_tokens == 128
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.greedy


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, top_k=50, top_p=0.5).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy


def test_lists_are_normalised_to_tuples():
    p = SamplingParams(stop=["\n\n", "User:"], stop_token_ids=[2, 7])
    assert p.stop == ("\n\n", "User:")
    assert p.stop_token_ids == (2, 7)
    assert SamplingParams(stop="END").stop == ("END",)
    hash(p)  # frozen and hashable, usable as a grouping key


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_valid_edges():
    SamplingParams(max_tokens=1, temperature=100, top_k=-1, top_p=1.0, seed=0)
    SamplingParams(top_k=0, top_p=1e-9, seed=-(2**63))
    SamplingParams(seed=2**64 - 1, ignore_eos=True)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", -5, ">= 1"),
        ("max_tokens", 2.5, "integer"),
        ("max_tokens", True, "integer"),
        ("max_tokens", "10", "integer"),
        ("temperature", -0.1, "[0, 100]"),
        ("temperature", 100.5, "[0, 100]"),
        ("temperature", float("nan"), "finite"),
        ("temperature", float("inf"), "finite"),
        ("temperature", "hot", "finite number"),
        ("temperature", None, "finite number"),
        ("top_k", -2, "0 or -1"),
        ("top_k", 1.5, "integer"),
        ("top_k", False, "integer"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", -0.3, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", float("nan"), "(0, 1]"),
        ("top_p", "0.9", "(0, 1]"),
        ("seed", 1.0, "integer"),
        ("seed", "42", "integer"),
        ("seed", True, "integer"),
        ("seed", 2**64, "2**64 - 1"),
        ("seed", -(2**63) - 1, "-2**63"),
        ("stop", [""], "empty string"),
        ("stop", ["ok", ""], "empty string"),
        ("stop", "", "empty string"),
        ("stop", [1], "strings"),
        ("stop", 5, "list"),
        ("stop", None, "list"),
        ("stop_token_ids", [-1], ">= 0"),
        ("stop_token_ids", [1.5], "integers"),
        ("stop_token_ids", [True], "integers"),
        ("stop_token_ids", 3, "list"),
        ("stop_token_ids", "12", "list"),
        ("ignore_eos", 1, "true or false"),
        ("ignore_eos", "yes", "true or false"),
    ],
)
def test_bad_values_name_the_field_and_why(field, value, why):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(field), message
    assert why in message, message
