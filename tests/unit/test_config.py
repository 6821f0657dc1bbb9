"""Config loading: defaults, YAML, overrides, and one-line errors naming the key."""

import glob
import importlib
import json
import os
import re
import subprocess

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, load_config, save_config
from meshrl.procs import zygote
from tests.conftest import DEFAULT_CONFIG, REPO

pytestmark = pytest.mark.unit


SHIPPED = {
    "grpo_default": ("algorithms.grpo", "GRPOConfig"),
    "grpo_calculator": ("algorithms.grpo", "GRPOConfig"),
    "grpo_calculator_notool": ("algorithms.grpo", "GRPOConfig"),
    "grpo_code": ("algorithms.grpo", "GRPOConfig"),
    "grpo_vision": ("algorithms.grpo", "GRPOConfig"),
    "dr_grpo": ("algorithms.grpo", "GRPOConfig"),
    "gspo": ("algorithms.grpo", "GRPOConfig"),
    "rloo": ("algorithms.rloo", "GRPOConfig"),
    "reinforce_pp": ("algorithms.reinforce_pp", "ReinforcePPConfig"),
    "dapo": ("algorithms.dapo", "DAPOConfig"),
    "ppo": ("algorithms.ppo", "PPOConfig"),
    "dpo": ("algorithms.dpo", "DPOConfig"),
    "distill": ("algorithms.distill", "DistillConfig"),
    "sft": ("algorithms.sft", "SFTConfig"),
    "coevolve": ("algorithms.coevolve", "CoevolveConfig"),
}
NEEDS = {"distill": ["teacher.path=null"]}  # its teacher is another run's output


def test_every_shipped_yaml_is_listed_here():
    paths = glob.glob(os.path.join(REPO, "algorithms", "configs", "*.yaml"))
    assert {os.path.basename(p)[:-5] for p in paths} == set(SHIPPED)


def test_overrides_win_and_types_are_converted():
    cfg = load_config(GRPOConfig, DEFAULT_CONFIG, ["steps=7", "optim.lr=0.5", "model.path=null"])
    assert cfg.steps == 7 and cfg.optim.lr == 0.5 and cfg.model.path is None
    assert isinstance(cfg, GRPOConfig)


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(GRPOConfig, DEFAULT_CONFIG, ["steps=3", "run.name=x"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(GRPOConfig, str(tmp_path / "config.yaml")) == cfg


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["stepz=3"], "stepz"),
        (["optim.lrr=1"], "optim.lrr"),
        (["steps=abc"], "steps"),
        (["optim.lr=fast"], "optim.lr"),
        (["generation.top_p=1.5"], "generation.top_p"),
        (["optim.schedule=sometimes"], "optim.schedule"),
        (["placement.trainer=3"], "placement.trainer"),
        (["task.name=chess"], "task.name"),
        (["task.max_digits=2"], "task.max_digits"),
        (["generation.overlong_prompt=truncate"], "generation.overlong_prompt"),
        (["model.max_positions=0"], "model.max_positions"),
        (["run.sinks=[neptune]"], "run.sinks"),
        (["model.path=/no/such/dir"], "/no/such/dir"),
        (["model.lora.rank=-1"], "model.lora.rank"),
        (["model.lora.save=pickle"], "model.lora.save"),
        (["model.lora.rank=4", "placement.sharding=fsdp"], "model.lora.rank"),
        (["model.lora.rank=4", "placement.sharding=tp", "placement.trainer=2"], "model.lora.rank"),
        (["placement.sharding=pq"], "placement.sharding"),
        (["placement.sharding=pp"], "placement.pp"),
        (["placement.sharding=pp", "placement.trainer=2", "model.arch=gpt2"], "placement.shard"),
        (["placement.sharding=pp", "placement.trainer=2", "placement.pp=4"], "placement.pp"),
        (
            ["placement.sharding=pp", "placement.trainer=2", "trainer.pp_schedule=interleaved"],
            "trainer.pp_schedule",
        ),
        (
            ["placement.sharding=pp", "placement.trainer=2", "trainer.routing_replay=true"],
            "trainer.routing_replay",
        ),
        (["placement.ep=2", "placement.trainer=2"], "placement.ep"),
        (
            ["placement.ep=2", "placement.trainer=2", "model.arch=qwen3_moe", "model.lora.rank=4"],
            "model.lora.rank",
        ),
        (["placement.ep=3", "placement.trainer=2", "model.arch=qwen3_moe"], "placement.ep"),
        (["placement.sharding=tp", "placement.trainer=2", "model.arch=gpt2"], "no tensor-paral"),
        (["placement.sharding=tp", "placement.trainer=2", "model.arch=phi3"], "colwise_gather"),
        (
            ["placement.sharding=tp", "placement.trainer=4", "model.num_heads=2"],
            "placement.trainer=4",
        ),
        (["placement.sharding=fsdp_tp", "placement.trainer=4", "placement.tp=3"], "placement.tp"),
        (["placement.policy_tp=3"], "placement.policy_tp"),  # 4 heads
        (["placement.policy_tp=2", "model.arch=gpt2"], "placement.policy_tp"),
        (["placement.policy_tp=2", "placement.colocate=true"], "placement.policy_tp"),
        (["placement.policy_tp=2", "policy.continuous=true"], "policy.continuous"),
        (["placement.policy_tp=2", "pool.schedule=[policy=2@3]"], "pool.schedule"),
        (["policy.engine=trt"], "policy.engine"),
        (["trainer.correction=magic"], "trainer.correction"),
        (["trainer.correction=icepop", "trainer.correction_low=6"], "trainer.correction_low"),
        (["trainer.correction=tis", "trainer.recompute_old_logprobs=false"], "trainer.recompute"),
        (["trainer.recompute_old_logprobs=maybe"], "trainer.recompute_old_logprobs"),
        (
            ["policy.engine=vllm", "generation.top_p=0.9", "trainer.recompute_old_logprobs=false"],
            "trainer.recompute_old_logprobs",
        ),
        (["generation.top_p=0.9", "trainer.recompute_old_logprobs=false"], "generation.top_p"),
        (["trainer.micro_batches=0"], "trainer.micro_batches"),
        (["trainer.micro_batches=200"], "trainer.micro_batches"),
        (["generation.min_new_tokens=9"], "generation.min_new_tokens"),
        (["steps"], "key=value"),
        (["trainer.routing_replay=true"], "trainer.routing_replay"),  # llama: no routers
        (["policy.record_routes=true", "model.arch=qwen2"], "policy.record_routes"),
        (
            ["trainer.routing_replay=true", "model.arch=qwen3_moe", "task.name=calculator"],
            "trainer.routing_replay",
        ),
        (["policy.dtype=float16"], "policy.dtype"),
        (["run.dashboard_port=70000"], "run.dashboard_port"),
        (["run.profile_steps=[3,1]"], "run.profile_steps"),
        (["run.profile_steps=[2]"], "run.profile_steps"),
        (["policy.dtype=bfloat16", "policy.engine=vllm"], "policy.dtype"),
        (["pool.schedule=[policy=3]"], "pool.schedule"),
        (["pool.schedule=[trainer=2@3]"], "trainer cannot be scaled"),
        (["pool.schedule=[policy=0@3]"], "a pool keeps at least 1 proc"),
        (["job.max_procs.policy=0"], "job.max_procs.policy"),
        (["rollout.dispatch=steal"], "rollout.dispatch"),
        (["rollout.overprovision=-1"], "rollout.overprovision"),
        (["rollout.dispatch=pull", "task.name=calculator"], "rollout.dispatch"),
        (["faults.slow=[trainer:0x4@1]"], "faults.slow"),
        (["faults.episode_latency=slow"], "faults.episode_latency"),
        (["kl_coef=0.1", "kl_kind=k1"], "kl_kind"),  # a KL loss term whose gradient is zero
    ],
)
def test_bad_values_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(GRPOConfig, DEFAULT_CONFIG, overrides)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found: .*nope.yaml"):
        load_config(GRPOConfig, str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(GRPOConfig, str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model:\n  hidden: 3\n")
    with pytest.raises(ConfigError, match=r"model\.hidden.*unknown.yaml"):
        load_config(GRPOConfig, str(unknown))


BAD_COMMANDS = [
    (["--config", DEFAULT_CONFIG, "stepz=3"], "stepz"),
    (["--config", DEFAULT_CONFIG, "steps=abc"], "steps"),
    (["--config", "/nope/grpo.yaml"], "/nope/grpo.yaml"),
    (["--config", DEFAULT_CONFIG, "--fast"], "--fast"),
    # No vllm and no GPU here: the one line says which, before any proc starts.
    (["--config", DEFAULT_CONFIG, "policy.engine=vllm"], "policy.engine': vllm is not"),
]


def test_cli_exits_with_one_line_before_spawning(no_stray_procs, tmp_path):
    """Each bad command, run side by side."""
    runs = []
    for i, (args, fragment) in enumerate(BAD_COMMANDS):
        run_dir = tmp_path / str(i)
        run_dir.mkdir()
        command = zygote.python_m("algorithms.grpo", *args, f"run.dir={run_dir}")
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        runs.append((args, fragment, run_dir, proc))
    for args, fragment, run_dir, proc in runs:
        try:
            stdout, stderr = proc.communicate(timeout=90)
        finally:
            proc.kill()
        lines = stderr.decode().strip().splitlines()
        assert proc.returncode == 2, (args, stderr)
        assert len(lines) == 1, (args, stderr)
        assert lines[0].startswith("error: ") and fragment in lines[0], (args, lines)
        assert stdout == b"", args
        assert not os.listdir(run_dir), args  # nothing was started, nothing written


def test_help_lists_every_key(capsys):
    from meshrl.config import parse_cli

    with pytest.raises(SystemExit) as info:
        parse_cli(GRPOConfig, ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for line in (
        "  steps=200\n      RL steps",
        "  placement.trainer=1\n",
        "  run.call_timeout_s=300.0",
    ):
        assert line in out


def test_every_key_has_a_docstring_and_the_config_reference_is_current():
    """The docstring under a config field is the key's one description: --help
    and docs/config/*.md are generated from it."""
    from algorithms.commands.config_reference import SCHEMAS
    from algorithms.commands.config_reference import main as reference_main
    from meshrl.config.docs import reference

    for name, (schema, _) in SCHEMAS.items():
        missing = [key for key, _, doc in reference(schema) if not doc]
        assert not missing, f"{name}: keys without a docstring: {missing}"
    assert reference_main(["--check"]) == 0


def test_base_key_chains_configs(tmp_path):
    (tmp_path / "parent.yaml").write_text("steps: 7\ngroup_size: 4\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ngroup_size: 2\n")
    cfg = load_config(GRPOConfig, str(tmp_path / "child.yaml"), ["kl_coef=0.5"])
    assert (cfg.steps, cfg.group_size, cfg.kl_coef) == (7, 2, 0.5)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(GRPOConfig, str(tmp_path / "loop.yaml"))
    (tmp_path / "orphan.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(GRPOConfig, str(tmp_path / "orphan.yaml"))


@pytest.mark.parametrize("config", sorted(SHIPPED))
def test_every_shipped_config_loads_and_names_its_command(config):
    module, schema = SHIPPED[config]
    path = os.path.join(REPO, "algorithms", "configs", f"{config}.yaml")
    cfg = load_config(getattr(importlib.import_module(module), schema), path, NEEDS.get(config))
    cfg.validate()
    with open(path) as f:
        header = f.read().split("\n\n")[0]
    assert f"python -m {module} --config algorithms/configs/{config}.yaml" in header


def test_a_missing_teacher_says_how_to_make_one():
    from algorithms.distill import DistillConfig

    path = os.path.join(REPO, "algorithms", "configs", "distill.yaml")
    with pytest.raises(ConfigError, match=r"'teacher.path': no such directory: /nope .*make run"):
        load_config(DistillConfig, path, ["teacher.path=/nope"])


def test_dpo_and_sft_take_the_trainer_section_and_name_a_moved_key(tmp_path):
    """DPO and SFT spawn their trainer from `trainer:` as GRPO does; a key they used
    to have at the top gets one line naming where it went, from a file or an
    override; a `trainer:` key about a sampler they do not have is refused."""
    from algorithms.dpo import DPOConfig
    from algorithms.sft import SFTConfig

    assert load_config(SFTConfig, None, ["trainer.micro_batches=2"]).trainer.micro_batches == 2
    old = tmp_path / "old.yaml"
    old.write_text("steps: 3\nlayout: packed\n")
    for schema, given, says in [
        (SFTConfig, ["micro_batches=2"], "'micro_batches' is now 'trainer.micro_batches'"),
        (DPOConfig, ["layout=padded"], "'layout' is now 'trainer.layout' (in override"),
        (DPOConfig, ["eval_every=5"], "'eval_every' is now 'eval.every'"),
        (DPOConfig, ["sft.steps=3"], "'sft' is now 'warm_start'"),
        (DPOConfig, ["trainer.correction=tis"], "trainer.correction': DPO samples nothing"),
        (DPOConfig, ["trainer.micro_batches=2"], "trainer.micro_batches': DPO steps on whole"),
        (SFTConfig, ["trainer.routing_replay=true"], "trainer.routing_replay': SFT samples no"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(schema, None, given)
    with pytest.raises(
        ConfigError, match=re.escape(f"'layout' is now 'trainer.layout' (in {old})")
    ):
        load_config(SFTConfig, str(old))


def test_ppo_keys_are_checked():
    from algorithms.ppo import PPOConfig

    with pytest.raises(ConfigError, match="lam"):
        load_config(PPOConfig, None, ["lam=2"])
    with pytest.raises(ConfigError, match="minibatches"):
        load_config(PPOConfig, None, ["prompts_per_step=6", "minibatches=4"])
    with pytest.raises(ConfigError, match="critic_optim.lr"):
        load_config(PPOConfig, None, ["critic_optim.lr=0"])


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from meshrl.config import ModelConfig
    from meshrl.model.models import embedded_config
    from meshrl.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    small = embedded_config(ModelConfig(), vocab_size=len(tokenizer) - 10)
    AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"'model.path': the tokenizer in .* has 98 tokens but"):
        load_config(GRPOConfig, None, [f"model.path={tmp_path}"])


def prompt_collector(cfg):
    """A `Collector` that only draws prompts (no meshes: nothing is generated)."""
    from meshrl.envs import make_task
    from meshrl.loop.collector import Collector
    from meshrl.loop.state import LoopState
    from meshrl.model.tokenizer import context_length, load_tokenizer

    state = LoopState(seed=cfg.run.seed)
    tokenizer, task = load_tokenizer(cfg.model), make_task(cfg.task)
    return state, Collector(
        cfg, state, None, None, tokenizer, task, context_length(cfg.model), None, None
    )


def test_overlong_prompts_are_skipped_and_counted_or_refused():
    from meshrl.loop.collector import PromptTooLong

    # Prompts of 3 to 6 digits are 5 to 8 tokens; the context leaves room for 6.
    keys = ["task.max_digits=6", "model.max_positions=11", "generation.max_new_tokens=5"]
    state, collector = prompt_collector(load_config(GRPOConfig, DEFAULT_CONFIG, keys))
    prompts = collector.sample_prompts(64)
    assert len(prompts) == 64
    assert {len(p.answer) for p in prompts} == {3, 4}
    assert state.counters["skipped_prompts"] > 0

    _, collector = prompt_collector(
        load_config(GRPOConfig, DEFAULT_CONFIG, [*keys, "generation.overlong_prompt=error"])
    )
    with pytest.raises(PromptTooLong, match="a prompt of [78] tokens does not fit .* of 11"):
        collector.sample_prompts(64)


def test_a_prompt_too_long_to_fit_is_tokenized_at_most_once(tmp_path):
    """A 2 MB row is known too long by its characters (never tokenized); a row
    a few tokens too long is tokenized the first time it is drawn, then skipped
    by its key."""
    rows = [{"prompt": "1" * (2 << 20), "answer": "x"}, {"prompt": "123456789", "answer": "x"}]
    rows += [{"prompt": "12", "answer": "21"}] * 2
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = ["task.name=math", f"task.dataset={tmp_path / 'rows.jsonl'}", "task.prompt_field=prompt"]
    keys += ["model.max_positions=12", "generation.max_new_tokens=5"]
    state, collector = prompt_collector(load_config(GRPOConfig, DEFAULT_CONFIG, keys))
    encoded = []
    encode = collector.encode
    collector.encode = lambda prompts: (encoded.extend(p.text for p in prompts), encode(prompts))[1]
    for _ in range(5):
        assert {p.text for p in collector.sample_prompts(8)} == {"12"}
    assert encoded.count("123456789") == 1 and "1" * (2 << 20) not in encoded
    assert state.counters["skipped_prompts"] > 2


@pytest.mark.parametrize(
    "row, says",
    [
        ({"prompt": None, "answer": "1"}, "line 2: field 'prompt' is null, not text"),
        ({"prompt": "  ", "answer": "1"}, "line 2: field 'prompt' is empty"),
        ({"prompt": "2+2", "answer": 4}, "line 2: field 'answer' is a int (4), not text"),
        ({"prompt": ["2", "+2"], "answer": "4"}, "line 2: field 'prompt' is a list"),
        ({"answer": "4"}, "line 2: missing field 'prompt'"),
    ],
)
def test_bad_dataset_rows_are_refused_when_the_config_loads(tmp_path, row, says):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match="config key 'task.dataset': dataset file") as info:
        load_config(GRPOConfig, DEFAULT_CONFIG, ["task.name=math", f"task.dataset={path}"])
    assert says in str(info.value) and str(path) in str(info.value)


def test_a_dataset_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"rows.jsonl, line 2: not UTF-8 \(byte 13"):
        load_config(GRPOConfig, DEFAULT_CONFIG, ["task.name=math", f"task.dataset={path}"])


def test_parquet_keeps_its_types_and_an_integer_answer_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["1+1", "2+2"], "answer": [2, 4]}), path)
    with pytest.raises(ConfigError, match=r"row 0: field 'answer' is a int \(2\), not text"):
        load_config(GRPOConfig, DEFAULT_CONFIG, ["task.name=math", f"task.dataset={path}"])


def test_the_vllm_engine_refuses_a_proc_without_it_in_one_line():
    """What a policy proc on a host without vllm or a GPU raises (a multi-host job
    whose controller cannot check the policy hosts up front)."""
    import torch

    from meshrl.config import ModelConfig, PolicyConfig
    from meshrl.model.engines import EngineUnavailable, make_engine
    from meshrl.model.models import load_model

    with pytest.raises(EngineUnavailable) as info:
        make_engine(PolicyConfig(engine="vllm"), load_model(ModelConfig()), ModelConfig(), 0, 1, 0)
    assert str(info.value).startswith("config key 'policy.engine': ")
    assert "\n" not in str(info.value)
    if not torch.cuda.is_available():
        assert "vllm is not installed" in str(info.value) or "CUDA GPU" in str(info.value)


def test_a_busy_serve_port_and_an_unreadable_override_are_one_line_naming_them():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"'policy.serve_port': port {port} is in use"):
            load_config(GRPOConfig, DEFAULT_CONFIG, [f"policy.serve_port={port}"])
    with pytest.raises(ConfigError, match=r"override 'task.name=\"abc': not a YAML value") as info:
        load_config(GRPOConfig, DEFAULT_CONFIG, ['task.name="abc'])
    assert "\n" not in str(info.value)


def test_one_line_keeps_a_wrapped_sentence_whole():
    from meshrl.procs.mesh import one_line

    error = ValueError(
        "The tokenizer at /x cannot be loaded because its vocabulary\nfile is missing.\n\nDetails: ..."
    )
    assert one_line(error) == (
        "ValueError: The tokenizer at /x cannot be loaded because its vocabulary file is missing."
    )


def test_a_placement_larger_than_the_machine_is_refused_before_any_proc_starts(
    tmp_path, no_stray_procs
):
    from algorithms.grpo import GRPO

    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        ["placement.policy=400", f"run.dir={tmp_path}", "run.progress=false"],
    )
    with pytest.raises(
        ConfigError,
        match=r"'placement': 402 procs \(.*policy=400\) need about .* GB of memory; this machine has",
    ):
        GRPO(cfg).run()
