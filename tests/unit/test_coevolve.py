"""Co-evolution's config: a game that does not exist is refused."""

import pytest

from algorithms.coevolve import CoevolveConfig
from meshrl.config import ConfigError, load_config
from tests.support.coevolve import CONFIG


@pytest.mark.unit
@pytest.mark.timeout(400)
def test_a_game_that_does_not_exist_is_refused():
    with pytest.raises(ConfigError, match="config key 'game': 'chess' is not one of kuhn_poker"):
        load_config(CoevolveConfig, CONFIG, ["game=chess"])
