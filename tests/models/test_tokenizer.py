"""load_tokenizer on a tiny BPE tokenizer built locally with the `tokenizers` library."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxrl4llm.models import load_tokenizer

CORPUS = ["The answer is 42.", "Let x = 3; then 2x + 1 = 7.", "Compute the sum of 1 and 2 and 3."] * 20


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    folder = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(folder)
    return folder


def test_load_tokenizer_round_trips_text(tokenizer_folder):
    tok = load_tokenizer(tokenizer_folder)
    text = "Let x = 42; then x + 1 = 43."
    ids = tok(text)["input_ids"]
    assert all(0 <= i < len(tok) for i in ids) and len(ids) < len(text)
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id == tok.eos_token_id


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_a_plain_tokenizer_folder_loads_as_auto_tokenizer_does_without_torch(tokenizer_folder):
    """The generic class straight from the folder: what AutoTokenizer gives (class, ids, special
    tokens, template), in a process that never imports torch."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    tok, auto = load_tokenizer(tokenizer_folder), AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
    text = "Compute the sum of 1 and 2. <|endoftext|>"
    assert type(tok) is type(auto) and tok(text)["input_ids"] == auto(text)["input_ids"]
    assert tok.get_vocab() == auto.get_vocab() and tok.init_kwargs == auto.init_kwargs
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.chat_template) == \
        (auto.eos_token_id, auto.pad_token_id, auto.bos_token_id, auto.chat_template)
    code = (f"import sys, json; from jaxrl4llm.models import load_tokenizer; t = load_tokenizer({str(tokenizer_folder)!r}); "
            f"print(json.dumps(['torch' in sys.modules, t({text!r})['input_ids']]))")
    torch_loaded, ids = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                  check=True).stdout.splitlines()[-1])
    assert not torch_loaded and ids == auto(text)["input_ids"]
