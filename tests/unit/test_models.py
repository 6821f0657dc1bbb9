"""Models, tokenizer and sampling without processes."""

import os
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.config import ModelConfig, TaskConfig
from meshrl.envs import make_task
from meshrl.envs.digits import positional_match
from meshrl.model.generation import sample, top_p_filter
from meshrl.model.models import ValueModel, completion_logprobs, load_model, stop_token_ids
from meshrl.model.tokenizer import build_char_tokenizer, load_tokenizer
from meshrl.weights.publisher import TornWeights, WeightPublisher
from meshrl.weights.receiver import WeightReceiver

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


def sampled(model, tok, prompts: list[str], **generation):
    """`prompts` encoded by `tok` (left-padded) and sampled by `model`, stopping at the
    tokenizer's EOS unless `generation` names other ids: the encoding and the sample."""
    enc = tok(prompts, padding=True, return_tensors="pt")
    generation = {"eos_token_id": tok.eos_token_id, **generation}
    out = sample(
        model,
        enc.input_ids,
        enc.attention_mask.float(),
        pad_token_id=tok.pad_token_id,
        generator=torch.Generator().manual_seed(0),
        **generation,
    )
    return enc, out


def test_sampling_logprobs_match_full_forward_and_stop_at_eos():
    torch.manual_seed(0)
    model = load_model(ModelConfig(), seed=0).eval()
    tok = build_char_tokenizer()
    enc, (ids, logprobs, mask) = sampled(
        model, tok, ["471>", "12>", "5>"], max_new_tokens=12, temperature=0.7
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


def test_behaviour_logprobs_are_those_of_the_distribution_sampled_from():
    """After temperature, the min_new_tokens ban and top-p (renormalized over the
    nucleus): vLLM's `processed_logprobs` mean the same, so both engines agree."""
    model = load_model(ModelConfig(), seed=0).eval()
    tok = build_char_tokenizer()
    temperature, top_p, min_new = 0.8, 0.6, 3
    enc, (ids, logprobs, mask) = sampled(
        model,
        tok,
        ["471>", "12>", "5>"] * 4,
        max_new_tokens=6,
        temperature=temperature,
        top_p=top_p,
        min_new_tokens=min_new,
    )
    full_ids = torch.cat([enc.input_ids, ids], 1)
    full_mask = torch.cat([enc.attention_mask, mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=full_mask).logits.float()
    width = enc.input_ids.shape[1]
    for t in range(ids.shape[1]):
        step = logits[:, width + t - 1] / temperature
        if t < min_new:
            step[:, tok.eos_token_id] = -float("inf")
        processed = top_p_filter(torch.softmax(step, -1), top_p)
        want = processed.gather(-1, ids[:, t : t + 1])[:, 0].log()
        live = mask[:, t].bool()
        torch.testing.assert_close(logprobs[live, t], want[live], atol=1e-5, rtol=1e-5)


def test_every_engine_stops_on_the_tokenizer_and_the_model_eos_ids():
    """A chat model ends a turn on its own EOS (generation_config) as well as the
    tokenizer's: the stop set holds both, and sampling stops on either."""
    model = load_model(ModelConfig(), seed=0).eval()
    tok = build_char_tokenizer()
    digit = tok.convert_tokens_to_ids("7")
    model.generation_config.eos_token_id = [tok.eos_token_id, digit]
    stop = stop_token_ids(model, tok)
    assert stop == sorted({tok.eos_token_id, digit})

    def sample_rows(min_new_tokens: int = 0):
        rows = ["471>"] * 64
        _, out = sampled(
            model, tok, rows, max_new_tokens=12, eos_token_id=stop, min_new_tokens=min_new_tokens
        )
        return out

    ids, _, mask = sample_rows()
    ended = 0
    for row in range(64):
        n = int(mask[row].sum())
        assert all(t not in stop for t in ids[row, : n - 1].tolist())  # nothing after a stop id
        ended += ids[row, n - 1].item() in stop
    assert ended > 0
    # min_new_tokens: no stop id before it; at max_new_tokens every row is full length.
    _, logprobs, mask = sample_rows(min_new_tokens=12)
    assert mask.shape == (64, 12) and bool(mask.all()) and bool((logprobs < 0).all())


def test_models_built_at_once_in_one_process_get_their_seeds_weights():
    """Actors of one proc (a colocated replica and its trainer) build their models
    in threads at the same time; each must still get exactly its seed's init."""
    want = load_model(ModelConfig(), seed=0).state_dict()
    built: list = []
    threads = [
        threading.Thread(target=lambda: built.append(load_model(ModelConfig(), seed=0)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for model in built:
        assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())


def test_a_value_model_draws_nothing_from_the_global_generator():
    """What a critic builds outside `seeded_init` must not draw from torch's global
    generator: a trainer beside it on the proc may be inside its seeded block (the
    invariance test's trainer got other weights in about half its runs when the value
    head was an nn.Linear's own init)."""
    lm = load_model(ModelConfig(), seed=0)
    state = torch.random.get_rng_state()
    model = ValueModel(lm)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not model.value_head.weight.any() and not model.value_head.bias.any()


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


def test_shared_memory_pull_is_bitwise_and_versioned():
    source, replica = load_model(ModelConfig(), seed=0), load_model(ModelConfig(), seed=1)
    publisher = WeightPublisher(source, rdma=False)
    receiver = WeightReceiver(replica)
    try:
        for version in range(3):
            with torch.no_grad():
                for p in source.parameters():
                    p.add_(0.5)
            receiver.pull(publisher.publish(version))
            assert (receiver.version, receiver.path) == (version, "shm")
            pairs = zip(source.parameters(), replica.parameters(), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs)
    finally:
        publisher.close()
    assert not any(os.path.exists(p) for p in publisher.paths)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copied", "served_in_place"])
def test_a_replica_pulling_while_the_trainer_publishes_never_serves_a_mixed_version(zero_copy):
    """A publisher thread writes versions 0..N (every parameter of version v equal
    to v) while the replica pulls the newest handle again and again: each pull
    either ends with one whole version or raises TornWeights. Served in place
    (`zero_copy`), the slot can be rewritten after the pull: whenever `intact()`
    holds after the parameters are read, what was read is one whole version."""
    cfg = ModelConfig(hidden_size=256, intermediate_size=1024, num_layers=4)
    source, replica = load_model(cfg), load_model(cfg)
    publisher = WeightPublisher(source, rdma=False)
    receiver = WeightReceiver(replica, zero_copy=zero_copy)
    latest: list = []
    done = threading.Event()

    def publish():
        for version in range(120):
            with torch.no_grad():
                for p in source.parameters():
                    p.fill_(version)
            latest.append(publisher.publish(version))
        done.set()

    thread = threading.Thread(target=publish)
    thread.start()
    outcomes = {"whole": 0, "torn": 0}
    try:
        while not done.is_set():
            if not latest:
                continue
            handle = latest[-1]
            try:
                receiver.pull(handle)
            except TornWeights:
                outcomes["torn"] += 1
                assert receiver.torn and receiver.version == -1
                continue
            read = [p.detach().clone() for p in replica.parameters()]
            if not receiver.intact():  # (served in place: its slot rewritten since)
                continue
            outcomes["whole"] += 1
            values = {p.flatten()[0].item() for p in read}
            assert values == {float(handle.version)}, values  # one version, all of it
            assert all((p == handle.version).all() for p in read)
    finally:
        thread.join()
        publisher.close()
    assert outcomes["whole"] > 0, outcomes


def test_checksum_is_the_same_taken_whole_in_chunks_or_unaligned_and_sees_one_byte():
    from meshrl.weights import checksum as sums

    data = torch.randn(3 * sums._CHUNK // 4 + 3)  # chunks, and a tail short of a word
    whole = sums.checksum(data)
    copied = torch.empty_like(data)
    as_bytes = data.view(torch.uint8)
    assert int(sums.copy_summed(copied.view(torch.uint8), as_bytes, True)) % 2**64 == whole
    assert torch.equal(copied, data)
    # A view that starts mid-word (a shard's rows) is summed the same as its copy.
    assert sums.checksum(as_bytes[4:]) == sums.checksum(as_bytes[4:].clone())
    flipped = as_bytes.clone()
    flipped[12345] ^= 1
    assert sums.checksum(flipped) != whole
    assert sums.checksum(torch.zeros(5)) != sums.checksum(torch.ones(5))


def test_the_compiled_copy_and_sum_equals_torchs_on_every_size_alignment_and_split(monkeypatch):
    """Both ways weight sync copies and sums (`meshrl.weights.checksum.copy_sums`):
    torch's two passes, and the fused kernel (`meshrl.weights.native`) where a C
    compiler is installed, against torch's word sums: empty, sub-word,
    word-tailed, unaligned and streaming-sized pairs, one batch split over 1 to 3
    threads at 64-byte cuts inside the pairs, and read-only pairs; every copy
    bitwise."""
    from meshrl.procs import compiled
    from meshrl.weights import checksum as sums
    from meshrl.weights import native

    monkeypatch.setattr(native, "SPLIT_BYTES", 1 << 12)  # small batches split over threads too
    generator = torch.Generator().manual_seed(0)
    buffer = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=generator)
    cases = [
        (0, 0),
        (5, 3),
        (0, 8),
        (1, 77),
        (64, 4096 + 5),
        (3, 70000),
        (16, 1 << 17),
        (8, 1 << 20),
    ]
    sources = [buffer[start : start + n] for start, n in cases]
    expected = [int(sums._word_sum(s)) % 2**64 for s in sources]

    def check() -> None:
        for threads in (1, 2, 3):
            monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
            # Destinations at odd offsets too (no streaming stores there).
            pool = torch.zeros(sum(n for _, n in cases) + 64 * len(cases), dtype=torch.uint8)
            dsts, at = [], 0
            for (_, n), shift in zip(cases, (0, 1, 16, 3, 0, 5, 0, 0), strict=True):
                at = -(-at // 64) * 64 + shift
                dsts.append(pool[at : at + n])
                at += n
            got = sums.copy_sums(list(zip(dsts, sources, strict=True)))
            assert [int(x) % 2**64 for x in got] == expected, threads
            assert all(torch.equal(d, s) for d, s in zip(dsts, sources, strict=True))
            read = sums.copy_sums([(s, None) for s in sources])
            assert [int(x) % 2**64 for x in read] == expected
        # A byte changed in a word's high half changes the sum (no carry lost).
        flipped = sources[-1].clone()
        flipped[7] ^= 0x80
        assert int(sums.copy_sums([(flipped, None)])[0]) % 2**64 != expected[-1]

    with monkeypatch.context() as torch_only:
        torch_only.setattr(native, "library", lambda: None)
        check()
    if compiled._compiler() is None:
        pytest.skip("no C compiler here: weight sync runs torch's two passes (checked above)")
    assert native.available(), "a C compiler is here, but the fused kernel did not build"
    check()


def test_the_compiled_kernel_is_built_only_in_a_directory_no_one_else_can_write(
    monkeypatch, tmp_path
):
    """A cache directory others can write (or not the user's) is not used: the
    kernel is built in a private temporary directory instead, and loads."""
    import ctypes
    import os

    from meshrl.procs import compiled
    from meshrl.weights import native

    if compiled._compiler() is None:
        pytest.skip("no C compiler here: nothing is built")
    shared = tmp_path / "meshrl"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(compiled, "_private", None)

    def build() -> str:
        return compiled._build(compiled._compiler(), "copy_sums", native.SOURCE, native.FLAGS)

    path = build()
    assert not path.startswith(str(shared)) and os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
    assert not list(shared.iterdir())
    ctypes.CDLL(path).meshrl_copy_sums  # noqa: B018 - it loads and has the kernel
    os.chmod(shared, 0o700)
    assert build().startswith(str(shared))
