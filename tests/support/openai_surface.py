"""A tiny model taught a few answers by heart, for tests/e2e/test_openai_surface.py:
greedy decoding then gives known text (a Hermes tool call, a malformed one, a
plain answer), so the endpoint's parsing, stops and streams can be checked with
the real sampler on real procs."""

from __future__ import annotations

from pathlib import Path

# Hermes/Qwen-like, in the char tokenizer's alphabet (printable ASCII, no newline):
# the tools' names in a system turn, an assistant's tool calls as <tool_call> JSON.
TEMPLATE = (
    "{%- if tools -%}[tools]{%- for t in tools -%}{{ t.function.name }};{%- endfor -%}</s>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}[assistant]{{ m.content or '' }}"
    '{%- for c in m.tool_calls -%}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{%- endfor -%}</s>'
    "{%- else -%}[{{ m.role }}]{{ m.content }}</s>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}[assistant]{%- endif -%}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWERS = [
    # (messages, tools, the answer taught)
    ([{"role": "user", "content": "weather?"}], [WEATHER], CALL),
    ([{"role": "user", "content": "broken?"}], [WEATHER], '<tool_call>{"name": get_w</tool_call>'),
    ([{"role": "user", "content": "count"}], None, "abc1def"),
    ([{"role": "user", "content": "count"}], [WEATHER], "abc1def"),  # tools, and no call
    (
        [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "x",
                        "type": "function",
                        # (an object, as chat templates take it: the endpoint parses
                        # the client's JSON text before rendering)
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "content": "sunny"},
        ],
        [WEATHER],
        "It is sunny.",
    ),
]


def teach(root: Path, steps: int = 300) -> Path:
    """Save under `root/model` a tiny Llama and a char tokenizer with TEMPLATE,
    trained until greedy decoding gives each of ANSWERS (then EOS) after its
    conversation. Returns the model's directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshrl.config import ModelConfig
    from meshrl.model.models import embedded_config
    from meshrl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256)
    model = AutoModelForCausalLM.from_config(embedded_config(cfg, len(tok)))
    rows = []
    for messages, tools, answer in ANSWERS:
        prompt = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = tok(prompt, add_special_tokens=False).input_ids
        target = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
        rows.append((ids, target))
    width = max(len(p) + len(t) for p, t in rows)
    inputs = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (prompt, target) in enumerate(rows):
        inputs[i, : len(prompt) + len(target)] = torch.tensor(prompt + target)
        labels[i, len(prompt) : len(prompt) + len(target)] = torch.tensor(target)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model"
