"""A byte-level BPE tokenizer built here (nothing is downloaded) with the tool formats' markers:
Qwen's ``<tool_call>`` family as plain added tokens (``special: false`` in Qwen2.5's and Qwen3's
tokenizer_config.json), the im / Llama 3.1 markers as special tokens, and the tool-turn part of
Qwen3's chat template (tests/tools/test_protocol.py, tests/sampling/test_tool_rollout.py)."""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|python_tag|>", "<|eom_id|>", "<|eot_id|>",
                  "<|start_header_id|>", "<|end_header_id|>"]
QWEN_TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CORPUS = ["```python\nprint(2 * 3)\n```\n```output\n6\n```\n", "The answer is \\boxed{6}.",
          "Let me compute it with code: the output is the product."] * 10

# The tool-turn part of Qwen3's chat template (Qwen/Qwen3-0.6B tokenizer_config.json, as TRL's
# trl/chat_template_utils.py reproduces it), verbatim: the assistant message's tool calls, the
# tool message and the generation prompt. Left out: the system/tools header and the <think>
# handling of earlier turns, which render nothing for these messages.
QWEN3_TOOL_TURN_TEMPLATE = r"""{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The BPE of CORPUS (330 tokens) + SPECIAL_TOKENS + QWEN_TOOL_TAGS, with QWEN3_TOOL_TURN_TEMPLATE."""
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TOOL_TAGS])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tok.chat_template = QWEN3_TOOL_TURN_TEMPLATE
    return tok
