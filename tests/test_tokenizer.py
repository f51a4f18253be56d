import json

import pytest
from bpe_fixture import CHAT_TOKENS, save_tokenizer

from moeserve.tokenizer import DEFAULT_CHAT_TEMPLATE, load_tokenizer, render_chat

MESSAGES = [
    {"role": "system", "content": "You are the bakery's assistant."},
    {"role": "user", "content": "One mawa cake, please. ₹?"},
]


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("plain"))


def test_load_tokenizer_and_default_template(plain_folder):
    tokenizer = load_tokenizer(plain_folder)
    assert tokenizer.eos_token_id is not None
    assert not tokenizer.chat_template
    text = render_chat(tokenizer, MESSAGES)
    assert text == (
        "<|system|>\nYou are the bakery's assistant.<|end|>\n"
        "<|user|>\nOne mawa cake, please. ₹?<|end|>\n"
        "<|assistant|>\n"
    )
    # The markers are single special tokens of the tokenizer, not spelled-out text.
    ids = tokenizer.encode(text, add_special_tokens=False)
    marker_ids = set(tokenizer.convert_tokens_to_ids(list(CHAT_TOKENS)))
    assert sum(i in marker_ids for i in ids) == 5
    assert render_chat(tokenizer, MESSAGES, add_generation_prompt=False).endswith("₹?<|end|>\n")


def test_tokenizer_own_template_wins(tmp_path):
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
    tokenizer = load_tokenizer(save_tokenizer(tmp_path, chat_template=own))
    assert render_chat(tokenizer, MESSAGES[1:]) == "[user] One mawa cake, please. ₹?\n[bot]"


def test_default_template_can_be_saved_with_a_tokenizer(tmp_path):
    tokenizer = load_tokenizer(save_tokenizer(tmp_path, chat_template=DEFAULT_CHAT_TEMPLATE))
    assert render_chat(tokenizer, MESSAGES) == render_chat(load_tokenizer(save_tokenizer(tmp_path / "x")), MESSAGES)


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_tokenizer(tmp_path / "no-such-model")


def test_folder_without_tokenizer_is_named(tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty-model"):
        load_tokenizer(empty)


def test_tokenizer_without_eos_is_rejected(tmp_path):
    folder = save_tokenizer(tmp_path / "no-eos")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.exists():
            config = json.loads(path.read_text())
            config.pop("eos_token", None)
            path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no-eos.*EOS"):
        load_tokenizer(folder)


@pytest.mark.parametrize(
    ("messages", "why"),
    [
        ("hello", "must be a list"),
        ([], "must not be empty"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\.role must be one of system, user, assistant"),
        ([MESSAGES[0], {"role": "user"}], r"messages\[1\]\.content must be a string"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
    ],
)
def test_bad_messages(plain_folder, messages, why):
    with pytest.raises(ValueError, match=why):
        render_chat(load_tokenizer(plain_folder), messages)


def test_template_errors_become_value_errors(tmp_path):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}"
    tokenizer = load_tokenizer(save_tokenizer(tmp_path, chat_template=strict))
    with pytest.raises(ValueError, match="first message must be the user"):
        render_chat(tokenizer, MESSAGES)
