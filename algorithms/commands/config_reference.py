"""Writes each algorithm's config reference to docs/config/ from the config
dataclasses' field docstrings (`meshrl.config.docs`):

    python -m algorithms.commands.config_reference          # rewrite docs/config/*.md
    python -m algorithms.commands.config_reference --check  # exit 1 if one is stale
"""

from __future__ import annotations

import os
import sys

from algorithms.coevolve import CoevolveConfig
from algorithms.dapo import DAPOConfig
from algorithms.distill import DistillConfig
from algorithms.dpo import DPOConfig
from algorithms.grpo import GRPOConfig
from algorithms.ppo import PPOConfig
from algorithms.reinforce_pp import ReinforcePPConfig
from algorithms.sft import SFTConfig
from meshrl.config.docs import markdown
from meshrl.config.generated import write_or_check

SCHEMAS = {
    "grpo": (GRPOConfig, "GRPO, GSPO, Dr. GRPO and RLOO config keys (`GRPOConfig`)"),
    "dapo": (DAPOConfig, "DAPO config keys (`DAPOConfig`)"),
    "reinforce_pp": (ReinforcePPConfig, "REINFORCE++ config keys (`ReinforcePPConfig`)"),
    "ppo": (PPOConfig, "PPO config keys (`PPOConfig`)"),
    "dpo": (DPOConfig, "DPO config keys (`DPOConfig`)"),
    "distill": (DistillConfig, "On-policy distillation config keys (`DistillConfig`)"),
    "sft": (SFTConfig, "SFT config keys (`SFTConfig`)"),
    "coevolve": (CoevolveConfig, "Co-evolution and self-play config keys (`CoevolveConfig`)"),
}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs", "config")


def pages() -> dict[str, str]:
    return {
        os.path.join(DOCS, f"{name}.md"): markdown(schema, title)
        for name, (schema, title) in SCHEMAS.items()
    }


def main(argv: list[str]) -> int:
    return write_or_check(
        pages(), "--check" in argv, "run python -m algorithms.commands.config_reference"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
