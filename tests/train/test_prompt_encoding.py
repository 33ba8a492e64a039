"""Every path that turns a prompt into token ids encodes it as training does (bin-difficulty
encoded chat prompts with the tokenizer's special tokens on top of the chat template's)."""

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from jaxrl4llm.data import encode_prompt_text, encode_prompts, format_prompt
from jaxrl4llm.train.binning import make_generate_fn


@pytest.fixture()
def bos_tokenizer(demo_assets):
    """The char tokenizer made to add a BOS token, as Llama's does (a chat template writes its own)."""
    tok = AutoTokenizer.from_pretrained(str(demo_assets["tokenizer"]))
    bos = tok.convert_tokens_to_ids(tok.bos_token)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A",
                                                       special_tokens=[(tok.bos_token, bos)])
    assert tok("ab")["input_ids"][0] == bos
    return tok


class _Policy:
    """What make_generate_fn needs of a Policy: records the ids it is asked to sample."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen = tokenizer, []

    def generate(self, ids, **_):
        self.seen.extend(ids)
        return None

    def decode(self, _):
        return ["" for _ in self.seen]


@pytest.mark.parametrize("template", ["chat", "base"])
def test_bin_difficulty_encodes_prompts_as_training_does(bos_tokenizer, template):
    problem = "What is 2 + 3?"
    text = format_prompt(problem, template, bos_tokenizer)
    (training,), _, _ = encode_prompts([problem], bos_tokenizer, template, max_prompt_tokens=4096)
    policy = _Policy(bos_tokenizer)
    make_generate_fn(policy, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, seed=0, template=template)([text], 1)
    assert policy.seen == [training] == [encode_prompt_text(text, bos_tokenizer, template)]
    plain = bos_tokenizer(text, add_special_tokens=False)["input_ids"]
    if template == "chat":  # the chat template wrote the prompt's special tokens: none added
        assert training == plain
    else:  # a plain prompt gets the tokenizer's BOS, as in training
        assert training == [bos_tokenizer.convert_tokens_to_ids(bos_tokenizer.bos_token)] + plain


def test_chat_messages_under_a_plain_template_get_no_extra_bos(bos_tokenizer):
    """A row of chat messages (TRL, verl) under the default `base` template is rendered by the chat
    template, so it is encoded without the tokenizer's BOS on top, as a chat template's prompt is."""
    from jaxrl4llm.data import Problem

    problem = Problem("2+3?", "5", "c0", messages=({"role": "user", "content": "2+3?"},))
    ids, _, _ = encode_prompts([problem], bos_tokenizer, "base", max_prompt_tokens=64)
    assert ids[0] == bos_tokenizer("user: 2+3?\nassistant:", add_special_tokens=False)["input_ids"]
    assert ids[0][0] != bos_tokenizer.bos_token_id
