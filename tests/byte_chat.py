"""A byte-level tokenizer with a Qwen-style chat template that renders tools and tool messages:
any text (JSON tool calls included) tokenizes, one token per byte, and the template puts a
default system prompt before a chat that has none and closes each message with `<|im_end|>\\n`,
as Qwen's does (so the turn loop inserts that `\\n` after a turn the model ended on `<|im_end|>`).
For the multi-turn tests."""

from __future__ import annotations

import os

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END)
VOCAB_SIZE = 256 + len(SPECIALS)
SYSTEM = "You are a helpful assistant."

CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}"
    "{% else %}<|im_start|>system\n" + SYSTEM + "{% endif %}"
    "{% if tools %}\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>{% endif %}"
    "<|im_end|>\n"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_byte_tokenizer(out_dir: str | os.PathLike | None = None):
    """The tokenizer (ids 0-255 the bytes, then `SPECIALS`; EOS `<|im_end|>`), saved to `out_dir` if given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=ENDOFTEXT,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tok.save_pretrained(os.fspath(out_dir))
    return tok


def _byte_of(char: str) -> int:
    """The byte that GPT-2's byte-level alphabet spells as `char`."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]
