"""A reward model's own input, as verl builds it (`reward_model.model.input_tokenizer`).

A reward model is trained on chats rendered with its own chat template and tokenizer, which need
not be the actor's. verl therefore does not hand it the actor's token ids: it decodes each response
with the input tokenizer (the actor's), drops the EOS text, appends the response to the prompt's
chat messages as the assistant turn, renders that chat with the reward model's template (no
generation prompt) and tokenizes the text as it is (the template writes any BOS itself). The
score is the model's output at the last token of that sequence.
"""

from __future__ import annotations

from typing import Any

from models.tokenizer import decode_batch


class RewardModelInputs:
    """`(raw prompts, response token ids) -> the reward model's token ids`, one list per row.

    `src_tokenizer` decodes the responses; `rm_tokenizer` (with a chat template) renders and
    tokenizes; `max_length` cuts each rendering on the right, as verl's FSDP reward model does
    (None: no limit)."""

    def __init__(self, src_tokenizer, rm_tokenizer, max_length: int | None = None):
        if not getattr(rm_tokenizer, "chat_template", None):
            raise ValueError("the reward model's tokenizer has no chat template")
        self.src, self.rm, self.max_length = src_tokenizer, rm_tokenizer, max_length

    def __call__(self, raw_prompts: list[Any], responses: list[list[int]]) -> list[list[int]]:
        texts = decode_batch(self.src, responses, skip_special_tokens=False)
        eos = self.src.eos_token
        rendered = []
        for i, (prompt, text) in enumerate(zip(raw_prompts, texts)):
            if not isinstance(prompt, list):
                raise TypeError(f"row {i}: the prompt is a {type(prompt).__name__}, not a list of chat messages")
            chat = list(prompt) + [{"role": "assistant", "content": text.replace(eos, "") if eos else text}]
            rendered.append(self.rm.apply_chat_template(chat, add_generation_prompt=False, tokenize=False))
        ids = [list(x) for x in self.rm(rendered, add_special_tokens=False)["input_ids"]]
        if self.max_length is not None:
            ids = [x[:self.max_length] for x in ids]
        return ids
