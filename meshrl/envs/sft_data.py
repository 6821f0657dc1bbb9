"""Supervised fine-tuning data: prompt/completion pairs or chat conversations,
tokenized once, with the loss on the assistant's tokens only.

A row is either
- a conversation, `{"messages": [{"role": ..., "content": ...}, ...]}`, rendered
  with the tokenizer's chat template; or
- a pair, `{"prompt": ..., "completion": ...}`. With a chat template it is the
  conversation [user: prompt, assistant: completion]. Without one the prompt
  is tokenized as an RL prompt is (BOS first) and the completion is followed by
  EOS, the token a sampled completion ends with.

The assistant's tokens are found by rendering the conversation up to each
assistant turn: the characters between the prefix with the generation prompt
and the prefix with the turn are the turn's, its end-of-turn marker included.
The whole conversation is tokenized once and every token that starts in such
a span counts in the loss. A template that renders earlier turns differently
once later ones are added (one that drops past reasoning, say) is refused: the
spans would not be the trained text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshrl.envs.dataset import DatasetError, read_records


@dataclass(frozen=True)
class Example:
    """One row's tokens: `prompt` before the first assistant token, `target` from
    it to the end, `counted` 1 on the target's assistant tokens."""

    prompt: list[int]
    target: list[int]
    counted: list[int]


def load_examples(
    path: str,
    tokenizer: Any,
    fields: tuple[str, str, str],
    context: int,
    key: str = "data.path",
) -> list[Example]:
    """Every row of `path` (`meshrl.envs.dataset.read_records`) as an `Example`.
    `fields`: the names of the prompt, completion and messages fields. A row
    that has neither a conversation nor a pair, no assistant turn, or more
    tokens than `context` is an error naming the file and the row."""
    prompt_field, completion_field, messages_field = fields
    examples = []
    for where, row in read_records(path, key):
        where = f"dataset file {path}, {where}"
        if messages_field in row:
            example = conversation(tokenizer, row[messages_field], where)
        elif prompt_field in row and completion_field in row:
            example = pair(tokenizer, row[prompt_field], row[completion_field], where)
        else:
            raise DatasetError(
                f"{where}: needs '{messages_field}' or '{prompt_field}' and "
                f"'{completion_field}' (fields: {', '.join(sorted(row))})"
            )
        length = len(example.prompt) + len(example.target)
        if length > context:
            raise DatasetError(
                f"{where}: {length} tokens do not fit the model's context of {context}"
            )
        examples.append(example)
    return examples


def pair(tokenizer: Any, prompt: Any, completion: Any, where: str) -> Example:
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DatasetError(f"{where}: the prompt and the completion must be strings")
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return conversation(tokenizer, messages, where)
    target = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return Example(tokenizer(prompt).input_ids, target, [1] * len(target))


def conversation(tokenizer: Any, messages: Any, where: str) -> Example:
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"{where}: a conversation needs a tokenizer with a chat template (model.path); "
            "this one has none: use prompt/completion rows"
        )
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise DatasetError(f"{where}: messages must be a list of {{role, content}} strings")
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise DatasetError(f"{where}: no assistant turn (nothing to learn from)")

    def render(upto: int, prompt: bool = False) -> str:
        if upto == 0:
            return ""
        return tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=prompt
        )

    text, spans = render(len(messages)), []
    for i in turns:
        before, through = render(i, prompt=True), render(i + 1)
        if not (through.startswith(before) and text.startswith(through)):
            raise DatasetError(
                f"{where}: the chat template renders earlier turns differently once later "
                "ones are added, so the assistant's tokens cannot be located"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    counted = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded.offset_mapping]
    if 1 not in counted:
        raise DatasetError(f"{where}: the assistant turns are empty")
    first = counted.index(1)
    ids = encoded.input_ids
    return Example(ids[:first], ids[first:], counted[first:])
