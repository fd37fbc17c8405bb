"""The `[pool]` section: defaults, refusals that name the key, and the groups it makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from packserve.config import PoolConfig, load_config
from packserve.errors import ConfigError
from tests.factories import fake_model


def _write(tmp_path: Path, pool: str) -> Path:
    path = tmp_path / "pool.toml"
    path.write_text(pool + fake_model("a", "pin = true") + fake_model("b") + fake_model("c"),
                    "utf-8")
    return path


def test_a_config_without_pool_gets_the_defaults() -> None:
    pool = load_config(None).pool
    assert pool == PoolConfig()
    assert (pool.min_replicas, pool.max_replicas, pool.router) == (2, 2, "packserve")


@pytest.mark.parametrize(("text", "reason"), [
    ("[pool]\nmin_replicas = 3\nmax_replicas = 2\n", "max_replicas (2) is below min_replicas"),
    ("[pool]\nrouter = \"random\"\n", "router"),
    ("[pool]\nmin_replicas = 0\n", "min_replicas"),
    ("[[pool.dedicated]]\nmodels = [\"zz\"]\n", "names zz, not in [[models]]"),
    ("[[pool.dedicated]]\nmodels = [\"b\"]\n[[pool.dedicated]]\nmodels = [\"b\"]\n",
     "model 'b' is in two"),
])
def test_bad_pool_sections_are_refused(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(ConfigError, match="pool") as info:
        load_config(_write(tmp_path, text))
    assert reason in info.value.message


def test_dedicated_models_leave_the_shared_group(tmp_path: Path) -> None:
    from packserve.pool.app import SHARED, deployment_options, groups

    config = load_config(_write(tmp_path, "[pool]\nmin_replicas = 1\nmax_replicas = 3\n"
                                          "[[pool.dedicated]]\nmodels = [\"c\"]\n"))
    shared, dedicated = groups(config)
    assert (shared.name, shared.models) == (SHARED, ("a", "b"))
    assert [m.name for m in shared.config.models] == ["a", "b"]
    assert dedicated.models == ("c",) and [m.name for m in dedicated.config.models] == ["c"]
    # The shared group scales between its bounds; the dedicated one is fixed at one replica.
    assert deployment_options(config, shared)["autoscaling_config"].max_replicas == 3
    assert deployment_options(config, dedicated)["num_replicas"] == 1


def test_a_groups_node_config_is_a_valid_config_on_its_own(tmp_path: Path) -> None:
    from packserve.config import Config
    from packserve.pool.app import groups

    config = load_config(_write(tmp_path, "[[pool.dedicated]]\nmodels = [\"c\"]\n"))
    for group in groups(config):  # what each replica reads back (pool.node.Node)
        again = Config.model_validate_json(group.config.model_dump_json())
        assert again.pool == PoolConfig() and [m.name for m in again.models] == list(
            group.models)
