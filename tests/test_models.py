"""Models, tokenizer and sampling without processes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.config import ModelConfig, TaskConfig
from meshrl.envs import make_task
from meshrl.envs.digits import positional_match
from meshrl.generation import sample, top_p_filter
from meshrl.models import build_char_tokenizer, completion_logprobs, load_model, load_tokenizer
from meshrl.weights import plan_buckets

pytestmark = pytest.mark.unit


def test_char_tokenizer_roundtrip():
    tok = build_char_tokenizer()
    ids = tok("471>").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 5
    assert tok.decode(ids[1:] + [tok.eos_token_id], skip_special_tokens=True) == "471>"
    batch = tok(["12>", "4567>"], padding=True)
    assert batch["attention_mask"][0][:2] == [0, 0]  # left padding


def test_save_pretrained_then_load_by_path(tmp_path):
    cfg = ModelConfig()
    model, tok = load_model(cfg, seed=3), load_tokenizer(cfg)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    by_path = ModelConfig(path=str(tmp_path))
    by_path.validate()
    loaded, loaded_tok = load_model(by_path), load_tokenizer(by_path)
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert loaded_tok("93>").input_ids == tok("93>").input_ids
    # and the stock HF entry points read the same directory
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), type(model))
    assert AutoTokenizer.from_pretrained(tmp_path).decode(tok("01").input_ids[1:]) == "01"


def test_same_seed_same_weights_other_seed_differs():
    a, b, c = (load_model(ModelConfig(), seed=s) for s in (0, 0, 1))
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = top_p_filter(probs, 0.7)
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_sampling_logprobs_match_full_forward_and_stop_at_eos():
    torch.manual_seed(0)
    model = load_model(ModelConfig(), seed=0).eval()
    tok = build_char_tokenizer()
    enc = tok(["471>", "12>", "5>"], padding=True, return_tensors="pt")
    gen = torch.Generator().manual_seed(0)
    ids, logprobs, mask = sample(
        model,
        enc.input_ids,
        enc.attention_mask.float(),
        max_new_tokens=12,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        temperature=0.7,
        generator=gen,
    )
    assert ids.shape == logprobs.shape == mask.shape and ids.shape[1] <= 12
    # after EOS: padding, masked out
    for row in range(3):
        n = int(mask[row].sum())
        if tok.eos_token_id in ids[row, :n].tolist():
            assert ids[row, n - 1] == tok.eos_token_id
        assert (ids[row, n:] == tok.pad_token_id).all()
    # the trainer's recomputation (no cache, whole sequence) agrees token for token
    full_ids = torch.cat([enc.input_ids, ids], 1)
    full_mask = torch.cat([enc.attention_mask.float(), mask], 1)
    with torch.no_grad():
        recomputed = completion_logprobs(model, full_ids, full_mask, ids.shape[1], temperature=0.7)
    assert torch.allclose(recomputed * mask, logprobs * mask, atol=1e-5)


def test_reverse_digits_reward_depends_on_prompt():
    import random

    task = make_task(TaskConfig(num_digits=3))
    prompts = task.sample(200, random.Random(0))
    assert all(p.text.endswith(">") and p.answer == p.text[:-1][::-1] for p in prompts)
    assert all(task.reward(p, p.answer) == 1.0 for p in prompts)
    # The best prompt-blind answer scores ~0.1.
    blind = max(
        sum(task.reward(p, guess) for p in prompts) / len(prompts)
        for guess in ("000", "123", "555", "", "9", "00000")
    )
    assert blind <= 0.2
    assert positional_match("1745", "174") == pytest.approx(0.75)
    assert positional_match("", "174") == 0.0


def test_bucket_plan_respects_bound_and_order():
    named = [
        ("a", torch.zeros(10)),
        ("b", torch.zeros(30)),
        ("c", torch.zeros(5)),
        ("d", torch.zeros(100)),
    ]
    slots, sizes = plan_buckets(named, bucket_bytes=160)
    assert [s.name for s in slots] == ["a", "b", "c", "d"]
    assert [s.bucket for s in slots] == [0, 0, 1, 2]
    assert sizes == [160, 20, 400]
    assert [s.offset for s in slots] == [0, 40, 0, 0]
